"""Swap Optimizer: optimizer states in (pinned) host memory, streamed to the device per slice.

Between steps every per-element state tensor of a wrapped ``torch.optim`` optimizer
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) lives in host memory --
pinned on an accelerator, so copies can run asynchronously. Scalar states such as
Adam's ``step`` stay where the optimizer keeps them (they are a few bytes and the
fused kernels read them on the device).

During ``step()`` the parameters are split into ``k`` contiguous slices of about
equal bytes, and one device buffer (the "arena") holds the slices in flight: even
slices at its start, odd slices at its end.

* side stream:    P0 P1 [wait U0] C0 P2 [wait U1] C1 P3 ...
* compute stream: [wait P0] U0 [wait P1] U1 [wait P2] U2 ...

``P`` copies a slice's states host -> arena, ``U`` is the optimizer's own update
restricted to that slice, ``C`` copies the updated states arena -> host. ``P(i+2)``
reuses the bytes of slice ``i`` and is queued on the side stream after ``C(i)``, so
stream order alone keeps them apart, and the copies of one slice overlap the update
of the next. The arena holds the largest pair of neighbouring slices, capped at
``total/k`` plus the largest slice (the goal); a pair above the cap shares bytes, so
its second slice is queued after the first one's copy-out (that one transfer is not
overlapped).
So the device holds at most about ``2/k`` of the state during ``step()`` and none
between steps. The host never waits inside ``step()`` (except on a slice whose state
the optimizer just created on the device, i.e. the first step); it waits for the
last copy before anything reads host state (``state_dict``, ``load_state_dict``).

The update of a slice is the optimizer's unmodified ``step`` (hooks excluded, they
run once per step around the whole loop) with ``param_groups`` narrowed to the
slice's parameters. torch's Adam/AdamW/SGD updates are per parameter and
elementwise (for-loop, foreach and fused alike), so parameters and states after
each step are bit-identical to the unswapped optimizer.

The optimizer object stays what it was (same class, ``state`` keys, ``state_dict``
layout), so torchtitan's flattening, DCP checkpoints and plain ``load_state_dict``
work unchanged, and checkpoints are interchangeable with the unswapped optimizer:
DCP records no device, only tensor contents. DTensor states stay DTensors (same
mesh and placements) with a host local tensor, as FSDP2's CPU offload does.

On the CPU rehearsal host and device are the same memory: the arena is a host
buffer and copies are synchronous, so there is no memory saving, but the code
path (slicing, staging, state_dict/load) is the same one the NPU runs.
"""

from __future__ import annotations

import contextlib
import types
from itertools import chain
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

# Optimizers whose update of one parameter reads only that parameter's grad and state
# (so a per-slice update equals the whole-model update).
PER_PARAMETER_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
ARENA_ALIGNMENT = 512  # bytes; the NPU allocator's alignment, a multiple of every dtype size


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` wrapped as a DTensor with ``template``'s layout, or ``local`` itself."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False,
        shape=template.shape, stride=template.stride(),
    )


def is_swapped_state(value: Any) -> bool:
    """Per-element state (not a scalar such as ``step``) is what moves to the host."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def slice_parameters(params: list[torch.Tensor], slices: int) -> list[list[torch.Tensor]]:
    """Contiguous runs of ``params`` with about ``1/slices`` of their bytes each (none empty).

    Each parameter goes to the slice its byte midpoint falls in, so no slice exceeds
    ``total/slices`` by more than half of one parameter on either side.
    """
    if slices < 1:
        raise ValueError(f"slices must be a positive integer, got {slices!r}")
    sizes = [_local(p).numel() * p.element_size() for p in params]
    total = sum(sizes) or 1
    result: list[list[torch.Tensor]] = [[] for _ in range(slices)]
    cumulative = 0
    for param, size in zip(params, sizes):
        index = min(slices - 1, int((cumulative + size / 2) * slices / total))
        result[index].append(param)
        cumulative += size
    return [part for part in result if part]


class StreamOps:
    """Stream/event operations on an accelerator's device module (``torch.npu``, ``torch.cuda``)."""

    asynchronous = True

    def __init__(self, device_module: types.ModuleType, device: torch.device) -> None:
        self.module = device_module
        self.device = device
        self.side = device_module.Stream(device=device)

    def compute(self):
        return self.module.current_stream(self.device)

    def on(self, stream) -> contextlib.AbstractContextManager:
        return self.module.stream(stream)

    @staticmethod
    def record(stream):
        return stream.record_event()

    @staticmethod
    def wait(stream, event) -> None:
        stream.wait_event(event)

    @staticmethod
    def wait_stream(stream, other) -> None:
        stream.wait_stream(other)

    @staticmethod
    def host_wait(event) -> None:
        event.synchronize()


class HostStreamOps:
    """Host == device (CPU rehearsal): work is synchronous, so ordering needs nothing."""

    asynchronous = False
    side = None

    def compute(self):
        return None

    def on(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def record(stream):
        return None

    @staticmethod
    def wait(stream, event) -> None:
        """Nothing is pending on the host."""

    @staticmethod
    def wait_stream(stream, other) -> None:
        """Nothing is pending on the host."""

    @staticmethod
    def host_wait(event) -> None:
        """Nothing is pending on the host."""


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The class's ``step`` without torch's hook/profiler wrapper (we run those once per step)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        return step.__wrapped__
    return step


class _Entry:
    """One swapped state tensor of one parameter during a step."""

    __slots__ = ("param", "key", "host", "nbytes", "offset")

    def __init__(self, param, key, host) -> None:
        self.param, self.key, self.host = param, key, host
        local = _local(host)
        self.nbytes = local.numel() * local.element_size()
        self.offset = 0


class SwapOptimizer:
    """Keeps one optimizer's per-element state on the host and streams it through an arena.

    ``install`` replaces the optimizer instance's ``step`` (keeping torch's step hooks
    around the whole step) and registers state-dict hooks; ``uninstall`` undoes both
    and brings the state back to the device.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, slices: int, device: torch.device,
                 streams: StreamOps | HostStreamOps, pin_memory: bool) -> None:
        if not isinstance(optimizer, PER_PARAMETER_OPTIMIZERS):
            names = ", ".join(c.__name__ for c in PER_PARAMETER_OPTIMIZERS)
            raise TypeError(
                f"the swap optimizer supports per-parameter updates ({names}), "
                f"not {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.device = device
        self.streams = streams
        self.pin_memory = pin_memory
        self.slice_count = slices
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.slices = slice_parameters(params, slices)
        self._param_ids = [id(p) for p in params]
        self._raw_step = _unhooked_step(optimizer)
        self._host_ready = None  # event after which host state may be read by the CPU
        self._handles: list = []
        self._stashed: list[tuple[torch.Tensor, dict[str, Any], list[str]]] = []

    # -- install -------------------------------------------------------------
    def install(self) -> "SwapOptimizer":
        optimizer = self.optimizer
        if "step" in vars(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step is already replaced on this instance "
                "(install the swap before building LR schedulers, and only once)"
            )
        hooked = torch.optim.Optimizer.profile_hook_step(self._step)
        optimizer.step = types.MethodType(hooked, optimizer)
        optimizer._npu_inject_swap = self
        self._handles = [
            optimizer.register_state_dict_pre_hook(lambda _opt: self.wait_host()),
            optimizer.register_load_state_dict_pre_hook(self._before_load),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        with torch.no_grad():
            self._offload_resident_state()
        return self

    # -- host memory -------------------------------------------------------------
    def _host_empty(self, local: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(local, device="cpu", pin_memory=self.pin_memory)

    @staticmethod
    def _is_host(value: torch.Tensor) -> bool:
        # On the CPU rehearsal everything is host memory and goes through the arena too.
        return _local(value).device.type == "cpu"

    def _offload_resident_state(self) -> None:
        """State that exists on the device when installing moves to the host."""
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if is_swapped_state(value) and not self._is_host(value):
                    host = self._host_empty(_local(value))
                    host.copy_(_local(value))
                    state[key] = _like(value, host)

    def wait_host(self) -> None:
        if self._host_ready is not None:
            self.streams.host_wait(self._host_ready)
            self._host_ready = None

    # -- step ------------------------------------------------------------------
    def _step(self, optimizer: torch.optim.Optimizer, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._swapped_update()
        return loss

    def _current_slices(self) -> list[list[torch.Tensor]]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if [id(p) for p in params] != self._param_ids:
            # A group was added or changed: slice again so no parameter is left out.
            self.slices = slice_parameters(params, self.slice_count)
            self._param_ids = [id(p) for p in params]
        return self.slices

    def _plan(self, slices) -> list[list[_Entry]]:
        """Per slice, the host-resident state entries to bring to the device, with offsets in the slice."""
        state = self.optimizer.state
        plans = []
        for part in slices:
            entries = [
                _Entry(p, key, value)
                for p in part if p in state
                for key, value in state[p].items()
                if is_swapped_state(value) and self._is_host(value)
            ]
            offset = 0
            for entry in entries:
                entry.offset = offset
                offset += _aligned(entry.nbytes)
            plans.append(entries)
        return plans

    def _swapped_update(self) -> None:
        optimizer, streams = self.optimizer, self.streams
        slices = self._current_slices()
        plans = self._plan(slices)
        sizes = [_aligned(plan[-1].offset + plan[-1].nbytes) if plan else 0 for plan in plans]
        state_bytes = [sum(entry.nbytes for entry in plan) for plan in plans]
        # The goal: 1/k of the state plus one (the largest) slice.
        budget = max(state_bytes, default=0) + sum(state_bytes) // max(len(plans), 1)
        capacity, bases, collides = arena_layout(sizes, budget)
        compute = streams.compute()
        # The arena is allocated in compute-stream order; the side stream writes it only
        # after the compute stream's pending work (which may have used that memory).
        arena = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        streams.wait_stream(streams.side, compute)
        ready: list = [None] * len(plans)
        views: list[dict[tuple[int, str], torch.Tensor]] = [{} for _ in plans]

        def prefetch(index: int) -> None:
            """Queue host -> arena copies of a slice on the side stream."""
            with streams.on(streams.side):
                for entry in plans[index]:
                    local = _local(entry.host)
                    start = bases[index] + entry.offset
                    view = arena[start:start + entry.nbytes].view(local.dtype).view(local.shape)
                    view.copy_(local, non_blocking=streams.asynchronous)
                    views[index][(id(entry.param), entry.key)] = _like(entry.host, view)
                ready[index] = streams.record(streams.side)

        copied = None
        groups = optimizer.param_groups
        try:
            for kind, index in side_stream_order(collides):
                if kind == "prefetch":
                    prefetch(index)
                    continue
                # "copy-out": the slice's update on the compute stream, then its copies back.
                part = slices[index]
                streams.wait(compute, ready[index])
                for entry in plans[index]:
                    optimizer.state[entry.param][entry.key] = views[index][(id(entry.param), entry.key)]
                optimizer.param_groups = _narrow_groups(groups, part)
                try:
                    self._raw_step(optimizer)
                finally:
                    optimizer.param_groups = groups
                updated = streams.record(compute)
                fresh = self._copy_out(part, plans[index], views[index], updated)
                copied = streams.record(streams.side)
                if fresh:
                    # The optimizer created these on the device (first step): wait for their
                    # copy before dropping them, so their memory is free for the next slice.
                    streams.host_wait(copied)
                    del fresh
                views[index].clear()
        finally:
            # Later compute-stream work (which may reuse the arena's memory) runs after the copies.
            if copied is not None:
                streams.wait(compute, copied)
            self._host_ready = copied
            del arena, views

    def _copy_out(self, part, entries: list[_Entry], views: dict, updated) -> list[torch.Tensor]:
        """Queue device -> host copies of ``part``'s state; returns device tensors not in the arena."""
        streams, state = self.streams, self.optimizer.state
        hosts = {(id(e.param), e.key): e.host for e in entries}
        in_arena = {id(v) for v in views.values()}
        fresh = []
        with streams.on(streams.side):
            streams.wait(streams.side, updated)
            for param in part:
                if param not in state:
                    continue
                for key, value in list(state[param].items()):
                    if not is_swapped_state(value) or (self._is_host(value) and id(value) not in in_arena):
                        continue
                    local = _local(value)
                    host = hosts.get((id(param), key))
                    if id(value) not in in_arena or host is None or _local(host).shape != local.shape \
                            or _local(host).dtype != local.dtype:
                        # Created (or replaced) by the optimizer during this update.
                        fresh.append(value)
                        host = _like(value, self._host_empty(local))
                    _local(host).copy_(local, non_blocking=streams.asynchronous)
                    state[param][key] = host
        return fresh

    # -- state dict ----------------------------------------------------------------
    def _before_load(self, optimizer, state_dict):
        """Keep per-element state out of torch's load, which would copy all of it onto the device."""
        self.wait_host()
        id_map = dict(zip(
            chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
            chain.from_iterable(g["params"] for g in optimizer.param_groups),
        ))
        kept = {}
        self._stashed = []
        for param_id, param_state in state_dict["state"].items():
            if param_id not in id_map or not isinstance(param_state, dict):
                kept[param_id] = param_state
                continue
            swapped = {k: v for k, v in param_state.items() if is_swapped_state(v)}
            self._stashed.append((id_map[param_id], swapped, list(param_state)))
            kept[param_id] = {k: v for k, v in param_state.items() if k not in swapped}
        return {**state_dict, "state": kept}

    def _after_load(self, optimizer) -> None:
        """Put the stashed state in host memory, cast to the parameter's dtype as torch's load does."""
        for param, swapped, order in self._stashed:
            current = optimizer.state[param]
            for key, value in swapped.items():
                local = _local(value)
                dtype = param.dtype if param.is_floating_point() else local.dtype
                if self._is_host(value) and local.dtype == dtype and (not self.pin_memory or local.is_pinned()):
                    current[key] = value  # e.g. DCP loaded in place into our own host tensors
                else:
                    host = self._host_empty(local.to(dtype=dtype))
                    host.copy_(local)
                    current[key] = _like(value, host)
            optimizer.state[param] = {k: current[k] for k in order if k in current}
        self._stashed = []


def arena_layout(sizes: list[int], budget: int) -> tuple[int, list[int], list[bool]]:
    """(capacity, base offset of each slice, whether slice j shares bytes with slice j-1).

    Even slices start at 0, odd slices end at the capacity. The capacity is the largest
    pair of neighbouring slices, but at most ``budget`` (never less than the largest
    slice); a pair above it shares bytes, so its second slice waits for the first one's
    copy-out.
    """
    if not sizes:
        return 0, [], []
    largest = max(sizes)
    pairs = max((a + b for a, b in zip(sizes, sizes[1:])), default=largest)
    # Slices' sizes are aligned; an aligned capacity keeps the odd slices' bases aligned too.
    capacity = max(largest, min(pairs, budget // ARENA_ALIGNMENT * ARENA_ALIGNMENT))
    bases = [0 if index % 2 == 0 else capacity - size for index, size in enumerate(sizes)]
    collides = [index > 0 and sizes[index - 1] + size > capacity for index, size in enumerate(sizes)]
    return capacity, bases, collides


def side_stream_order(collides: list[bool]) -> list[tuple[str, int]]:
    """The order in which slice copies are queued on the side stream.

    ``("prefetch", j)`` copies slice j in; ``("copy-out", i)`` follows slice i's update on
    the compute stream and copies it back. Slice j is prefetched after the copy-out of
    slice j-2 (same end of the arena) and, when it collides with slice j-1, after that
    slice's copy-out too; otherwise as early as that allows, to overlap the update before.
    """
    count = len(collides)
    order: list[tuple[str, int]] = []
    issued: set[int] = set()

    def prefetch(index: int) -> None:
        order.append(("prefetch", index))
        issued.add(index)

    if count:
        prefetch(0)
    if count > 1 and not collides[1]:
        prefetch(1)
    for index in range(count):
        order.append(("copy-out", index))
        if index + 1 < count and index + 1 not in issued:
            prefetch(index + 1)
        if index + 2 < count and not collides[index + 2]:
            prefetch(index + 2)
    return order


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGNMENT) * ARENA_ALIGNMENT


def _narrow_groups(groups: list[dict], part: list[torch.Tensor]) -> list[dict]:
    """``groups`` restricted to ``part`` (same hyperparameters, only the slice's parameters)."""
    part_ids = {id(p) for p in part}
    narrowed = []
    for group in groups:
        keep = [i for i, p in enumerate(group["params"]) if id(p) in part_ids]
        if not keep:
            continue
        view = {**group, "params": [group["params"][i] for i in keep]}
        if "param_names" in group:
            view["param_names"] = [group["param_names"][i] for i in keep]
        narrowed.append(view)
    return narrowed


def install(optimizer: torch.optim.Optimizer, slices: int, device: torch.device,
            device_module: types.ModuleType | None) -> SwapOptimizer:
    """Swap ``optimizer``'s state: pinned host + streams on an accelerator, copies on the host."""
    if device.type == "cpu" or device_module is None:
        streams: StreamOps | HostStreamOps = HostStreamOps()
        pin = False
    else:
        streams = StreamOps(device_module, device)
        pin = True
    return SwapOptimizer(optimizer, slices, device, streams, pin).install()


def installed(optimizer: torch.optim.Optimizer) -> SwapOptimizer | None:
    return vars(optimizer).get("_npu_inject_swap")
