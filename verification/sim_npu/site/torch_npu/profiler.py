"""``torch_npu.profiler`` for the simulated NPU: torch's profiler behind torch_npu's names.

The real module records host and NPU activity through Ascend's msprof and writes one
``<worker>_<timestamp>_ascend_pt`` directory per trace (``ASCEND_PROFILER_OUTPUT/
trace_view.json`` is the Chrome trace). The simulated device runs its kernels on the
host, so this stand-in records CPU activity only (``ProfilerActivity.NPU`` adds
nothing) with ``torch.profiler`` and writes the Chrome trace at the same path, so
code that drives torch_npu's profiler can be tested here. It measures nothing about
an NPU.
"""

from __future__ import annotations

import enum
import os
import time

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
    """Writes ``<dir_name>/<worker>_<timestamp>_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json``."""
    dir_name = dir_name or "./"
    worker_name = worker_name or f"{os.uname().nodename}_{os.getpid()}"

    def handler(prof) -> None:
        stamp = time.strftime("%Y%m%d%H%M%S") + f"{int(time.time() * 1000) % 1000:03d}"
        output = os.path.join(dir_name, f"{worker_name}_{stamp}_ascend_pt", "ASCEND_PROFILER_OUTPUT")
        os.makedirs(output, exist_ok=True)
        prof.export_chrome_trace(os.path.join(output, "trace_view.json"))

    return handler
