"""The planner's caching-allocator model against torch_npu 2.14.0's own allocator, live on the CANN emulation.

A child process in the emulation's venv makes a seeded sequence of allocations and frees on two
streams (sizes from 1 byte to 150 MiB: both pools, every segment rule, splits, merges) and reports
torch.npu.memory_stats() after every event; the model replays the same sequence, and both must agree
on every event's allocated and reserved bytes, and on the peaks.

    .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu/test_planner_allocator.py -n 0
"""

from __future__ import annotations

import random

import pytest

from cann_emu_child import child_json

from npu_inject.planner.allocator import MiB, CachingAllocator


def _sequence(seed: int, events: int = 400) -> list[tuple[str, int, int, int]]:
    """("malloc", handle, bytes, stream) / ("free", handle, 0, 0) events; about a third are frees."""
    rng = random.Random(seed)
    sizes = [lambda: rng.randint(1, 4096), lambda: rng.randint(4096, 1 * MiB + 4096),
             lambda: rng.randint(1 * MiB, 12 * MiB), lambda: rng.randint(10 * MiB, 150 * MiB)]
    live, out = [], []
    for handle in range(events):
        if live and rng.random() < 0.35:
            out.append(("free", live.pop(rng.randrange(len(live))), 0, 0))
        out.append(("malloc", handle, rng.choice(sizes)(), rng.choice((0, 0, 0, 1))))
        live.append(handle)
    return out


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable_segments"])
def test_model_replays_the_real_allocator_event_by_event(expandable):
    sequence = _sequence(7)
    real = child_json(
        f"""
        import json, torch, torch_npu
        side = torch.npu.Stream()
        streams = {{0: torch.npu.current_stream(), 1: side}}
        held, trace = {{}}, []
        for kind, handle, nbytes, stream in {sequence!r}:
            if kind == "malloc":
                with torch.npu.stream(streams[stream]):
                    held[handle] = torch.empty(nbytes, dtype=torch.uint8, device="npu")
            else:
                del held[handle]
            stats = torch.npu.memory_stats()
            trace.append((stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]))
        stats = torch.npu.memory_stats()
        print(json.dumps({{"trace": trace, "peak": (stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"])}}))
        """,
        extra_env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"} if expandable else None,
        timeout=600,
    )
    model = CachingAllocator(expandable=expandable)
    for index, (kind, handle, nbytes, stream) in enumerate(sequence):
        model.malloc(handle, nbytes, stream) if kind == "malloc" else model.free(handle)
        assert (model.stats.allocated, model.stats.reserved) == tuple(real["trace"][index]), (
            f"event {index}: {kind} {nbytes} B on stream {stream}")
    assert (model.stats.peak_allocated, model.stats.peak_reserved) == tuple(real["peak"])
