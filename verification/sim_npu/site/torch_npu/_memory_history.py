"""``torch.npu.memory`` for the simulated NPU: the memory-snapshot calls, without a history.

torch_npu's ``torch.npu.memory._record_memory_history`` / ``_snapshot`` record the NPU
caching allocator's alloc/free events in PyTorch's snapshot format (pytorch.org/memory_viz).
The simulator's allocator keeps no such history: recording is accepted and a snapshot
has the keys torch_npu's has (``segments``, ``device_traces``: its ``_snapshot`` docstring,
checked by tests/contract/test_torch_npu_contract.py) with no segments and no trace entries.
Enough to test code that takes snapshots; nothing to learn about memory from.
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
    return {"segments": [], "device_traces": [[] for _ in range(torch.npu.device_count())]}


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
    import pickle

    with open(filename, "wb") as output:
        pickle.dump(_snapshot(), output)
