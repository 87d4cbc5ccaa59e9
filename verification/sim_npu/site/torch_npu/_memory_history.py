"""``torch.npu.memory`` for the simulated NPU: the memory-snapshot calls, without a history.

torch_npu's ``torch.npu.memory._record_memory_history`` / ``_snapshot`` record the NPU
caching allocator's alloc/free events in PyTorch's snapshot format (pytorch.org/memory_viz).
The simulator's allocator keeps no such history: recording is accepted and a snapshot
has the format's keys, the current figures of the simulated device, and no segments or
traces -- it says so under ``"simulated"``. Enough to test code that takes snapshots;
nothing to learn about memory from.
"""

from __future__ import annotations

import sys

import torch

_recording = {"enabled": None}


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None):
    if enabled not in (None, "state", "all"):
        raise ValueError(f"_record_memory_history: enabled must be None, 'state' or 'all', got {enabled!r}")
    _recording["enabled"] = enabled


def _snapshot(device=None, augment_with_fx_traces=False):
    index = torch.npu.current_device() if device is None else torch.device("npu", device).index or 0
    return {
        "segments": [],
        "device_traces": [[] for _ in range(torch.npu.device_count())],
        "allocator_settings": {},
        "simulated": (f"simulated NPU: no allocator history (recording={_recording['enabled']!r}); "
                      f"npu:{index} allocated {torch.npu.memory_allocated(index)} B now"),
    }


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
    import pickle

    with open(filename, "wb") as output:
        pickle.dump(_snapshot(), output)
