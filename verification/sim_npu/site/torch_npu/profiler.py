"""``torch_npu.profiler`` for the simulated NPU: torch's profiler behind torch_npu's names.

The real module records host and NPU activity through Ascend's msprof and writes one
``<worker>_<pid>_<timestamp>_ascend_pt`` directory per trace (worker: ``worker_name`` or
the host name; ``ASCEND_PROFILER_OUTPUT/trace_view.json`` is the Chrome trace, a JSON
array of events). The simulated device runs its kernels on the host, so this stand-in
records CPU activity only (``ProfilerActivity.NPU`` adds nothing) with ``torch.profiler``
and writes the trace's events at the same path, in the same form, so code that drives
torch_npu's profiler can be tested here (tests/contract/test_torch_npu_contract.py compares the
layout with the real wheel's source). It measures nothing about an NPU.
"""

from __future__ import annotations

import enum
import json
import os
import socket
from datetime import datetime, timezone

import torch

__all__ = ["ProfilerActivity", "profile", "schedule", "tensorboard_trace_handler"]


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


schedule = torch.profiler.schedule  # same arguments and semantics as torch_npu.profiler.schedule


class profile(torch.profiler.profile):
    """torch_npu.profiler.profile's keyword arguments; records host (CPU) activity."""

    def __init__(self, *, activities=None, schedule=None, on_trace_ready=None, record_shapes=False,
                 profile_memory=False, with_stack=False, with_flops=False, with_modules=False,
                 experimental_config=None):
        unknown = [a for a in (activities or ()) if not isinstance(a, ProfilerActivity)]
        if unknown:
            raise TypeError(f"torch_npu.profiler.profile (simulated): activities must be "
                            f"torch_npu.profiler.ProfilerActivity members, got {unknown!r}")
        super().__init__(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                         on_trace_ready=on_trace_ready, record_shapes=record_shapes,
                         profile_memory=profile_memory, with_stack=with_stack, with_flops=with_flops,
                         with_modules=with_modules)


def tensorboard_trace_handler(dir_name: str | None = None, worker_name: str | None = None,
                              analyse_flag: bool = True, async_mode: bool = False):
    """Writes ``<dir_name>/<worker>_<pid>_<timestamp>_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json``
    (torch_npu's profiler/_profiler_path_creator.py: local time to the millisecond)."""
    dir_name = dir_name or os.getcwd()

    def handler(prof) -> None:
        stamp = datetime.now(tz=timezone.utc).astimezone().strftime("%Y%m%d%H%M%S%f")[:-3]
        folder = f"{worker_name or socket.gethostname()}_{os.getpid()}_{stamp}_ascend_pt"
        output = os.path.join(dir_name, folder, "ASCEND_PROFILER_OUTPUT")
        os.makedirs(output, exist_ok=True)
        chrome_trace = os.path.join(output, "trace_view.json")
        prof.export_chrome_trace(chrome_trace)
        with open(chrome_trace, encoding="utf-8") as written:
            events = json.load(written)["traceEvents"]
        with open(chrome_trace, "w", encoding="utf-8") as rewritten:
            json.dump(events, rewritten)  # torch_npu writes the event array, not torch's {"traceEvents": ...}

    return handler
