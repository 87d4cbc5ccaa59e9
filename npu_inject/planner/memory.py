"""A rank's device memory over its training step: the recorded allocations replayed through the allocator model.

The replay walks the trace in order: at each operator, the storages freed since the previous one are
freed, then the operator's new storages allocated, on the stream they were allocated on; torchtitan's
``reset_peak_memory_stats`` and ``empty_cache`` calls (trace marks) happen where torchtitan makes them.
It yields what ``torch.npu.memory_stats()`` would report (allocated and reserved bytes, current and
peak per step) and, for the timeline, the live bytes of each category.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from npu_inject.planner.allocator import CachingAllocator
from npu_inject.planner.costmodel import module_key

CATEGORIES = ("parameters", "gradients", "optimizer states", "activations", "temporaries", "communication")


@dataclass
class StepMemory:
    peak_allocated: int = 0
    peak_reserved: int = 0
    # Live bytes per category at the moment allocated memory peaked.
    at_peak: dict[str, int] = field(default_factory=dict)
    # The most allocated while each top-level module's operators ran (costmodel.module_key): where in the step
    # the peak can be, for extrapolating a shallow recording (job._extrapolate).
    by_module: dict[str, int] = field(default_factory=dict)


@dataclass
class MemoryResult:
    steps: dict[str, StepMemory]  # "step 1", "step 2", ...: the peaks torchtitan would log for each step
    peak_allocated: int  # over the whole trace
    peak_reserved: int
    timeline: list[tuple[int, int, int, dict[str, int]]]  # (op index, allocated, reserved, live bytes by category)
    segments: int
    retries: int = 0  # the device was full and the cache released (a slow step, not a failure)
    failed: int = 0  # allocations that did not fit at all: out of memory


def replay(trace, *, pad: int, expandable: bool, device_memory: int, limit: int | None = None,
           timeline_points: int = 400) -> MemoryResult:
    allocator = CachingAllocator(pad=pad, expandable=expandable, device_memory=device_memory, limit=limit)
    allocations_at: dict[int, list] = defaultdict(list)
    frees_at: dict[int, list] = defaultdict(list)
    for allocation in trace.allocations:
        allocations_at[allocation.op].append(allocation)
        if allocation.freed is not None:
            frees_at[allocation.freed].append(allocation)
    marks_at: dict[int, list[str]] = defaultdict(list)
    for index, event in trace.marks:
        marks_at[index].append(event)
    live = defaultdict(int)
    steps: dict[str, StepMemory] = {}
    current: StepMemory | None = None
    every = max(1, len(trace.ops) // timeline_points)
    timeline = []
    stats = allocator.stats
    peak_allocated = peak_reserved = 0
    for index in range(-1, len(trace.ops) + 1):
        for event in marks_at.get(index, ()):
            if event == "reset_peaks":
                allocator.reset_peaks()
            elif event == "empty_cache":
                allocator.empty_cache()
            elif event.startswith("step "):
                current = steps.setdefault(event, StepMemory())
                allocator.reset_peaks()
        for allocation in frees_at.get(index, ()):
            if allocation.op <= index:
                allocator.free(allocation.id)
                live[allocation.category] -= allocation.nbytes
        for allocation in allocations_at.get(index, ()):
            if allocation.freed is not None and allocation.freed <= allocation.op:
                continue  # freed before the op finished: a temporary inside it, never live between ops
            allocator.malloc(allocation.id, allocation.nbytes, allocation.stream)
            live[allocation.category] += allocation.nbytes
        peak_allocated, peak_reserved = max(peak_allocated, stats.allocated), max(peak_reserved, stats.reserved)
        if current is not None:
            if stats.allocated > current.peak_allocated:
                current.peak_allocated = stats.allocated
                current.at_peak = {name: live[name] for name in CATEGORIES}
            current.peak_reserved = max(current.peak_reserved, stats.reserved)
            if 0 <= index < len(trace.ops):
                key = module_key(trace.ops[index])
                current.by_module[key] = max(current.by_module.get(key, 0), stats.allocated)
        if index % every == 0:
            timeline.append((index, stats.allocated, stats.reserved, {name: live[name] for name in CATEGORIES}))
    return MemoryResult(steps, peak_allocated, peak_reserved, timeline, stats.segments, stats.retries, stats.failed)
