"""``torch.npu`` of the simulated NPU (registered with torch._register_device_module).

Device count, current device, memory figures and RNG all come from the C++
extension (torch.ops.npu_sim / torch.accelerator); nothing here is a constant
except the device name and capability, which a simulator has to invent.

Work runs synchronously, so streams and events are API-compatible bookkeeping:
events complete when recorded, synchronize() returns at once.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from torch_npu import _audit

DEVICE_NAME = "Ascend910B-sim"

_device_t = torch.device | str | int | None


# -- devices ----------------------------------------------------------------


def _device_index(device: _device_t, *, optional: bool = True) -> int:
    """Index of an npu device given as None (current), int, "npu[:i]" or torch.device."""
    if device is None:
        if not optional:
            raise ValueError("An npu device is required, got None.")
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        parsed = torch.device(device)
        if parsed.type != "npu":
            raise ValueError(f"Expected an npu device, got {parsed}.")
        index = current_device() if parsed.index is None else parsed.index
    count = device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"Invalid npu device index {index}: the simulated NPU has {count} devices "
            f"(TORCHTITAN_NPU_SIM_DEVICES); valid indices are 0..{count - 1}."
        )
    return index


def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return True


def init() -> None:
    """Nothing to initialise: the simulator is ready once torch_npu is imported."""


def _lazy_init() -> None:
    """Nothing to initialise lazily (see init)."""


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return int(torch.ops.npu_sim.device_count())


def current_device() -> int:
    return int(torch.ops.npu_sim.current_device())


def set_device(device: _device_t) -> None:
    if isinstance(device, int) and device < 0:
        return  # like torch.cuda.set_device: a negative index is a no-op
    torch.ops.npu_sim.set_device(_device_index(device, optional=False))


class device:
    """Context manager that makes ``device`` the current npu device."""

    def __init__(self, device: _device_t) -> None:
        negative = isinstance(device, int) and device < 0
        self.index = -1 if device is None or negative else _device_index(device)
        self._previous = -1

    def __enter__(self) -> None:
        self._previous = current_device()
        if self.index >= 0:
            set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.index >= 0:
            set_device(self._previous)


class device_of(device):
    """Context manager that makes the device of ``tensor`` current (if it is an npu tensor)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor.get_device() if tensor.device.type == "npu" else None)


def synchronize(device: _device_t = None) -> None:
    index = _device_index(device)  # validates; kernels already ran synchronously
    audit = _audit.active()
    if audit is not None:
        audit.sync("synchronize", f"torch.npu.synchronize(npu:{index})")
        audit.stream_order.host_waits_for_device(index)


@dataclass(frozen=True)
class _DeviceProperties:
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_simulated: bool = True


def get_device_name(device: _device_t = None) -> str:
    _device_index(device)
    return DEVICE_NAME


def get_device_capability(device: _device_t = None) -> tuple[int, int]:
    """(0, 0): Ascend has no CUDA compute capability; code gating on it must not treat npu as a GPU."""
    _device_index(device)
    return (0, 0)


def get_device_properties(device: _device_t = None) -> _DeviceProperties:
    _device_index(device)
    return _DeviceProperties(
        name=DEVICE_NAME,
        total_memory=int(torch.ops.npu_sim.capacity_bytes()),
        major=0,
        minor=0,
        multi_processor_count=1,
    )


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# -- streams and events -------------------------------------------------------


class Stream(torch.Stream):
    """An npu stream (generic torch.Stream on the "npu" device type)."""

    def __new__(
        cls,
        device: _device_t = None,
        priority: int = 0,
        *,
        stream_id: int | None = None,
        device_index: int | None = None,
        device_type: int | None = None,
        **kwargs: Any,
    ) -> "Stream":
        if stream_id is not None:
            return super().__new__(
                cls, stream_id=stream_id, device_index=device_index, device_type=device_type
            )
        index = _device_index(device)
        return super().__new__(cls, device=torch.device("npu", index), priority=priority)

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        # torch.Stream.record_event accepts only exact torch.Event instances.
        if event is None:
            event = Event(device=torch.device("npu", self.device_index))
        event.record(self)
        return event

    # The audit (TORCHTITAN_NPU_SIM_AUDIT=1) orders streams by these calls.
    def wait_event(self, event: torch.Event) -> None:
        super().wait_event(event)
        audit = _audit.active()
        if audit is not None:
            audit.stream_order.wait_event(_audit._stream_key(self), event.event_id)

    def wait_stream(self, stream: torch.Stream) -> None:
        super().wait_stream(stream)
        audit = _audit.active()
        if audit is not None:
            audit.stream_order.wait_stream(_audit._stream_key(self), _audit._stream_key(stream))

    def synchronize(self) -> None:
        super().synchronize()
        audit = _audit.active()
        if audit is not None:
            audit.sync("synchronize", f"Stream.synchronize (stream {self.stream_id})")
            audit.stream_order.host_waits_for_stream(_audit._stream_key(self))

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device=npu:{self.device_index} stream_id={self.stream_id}>"


def _as_npu_stream(stream: torch.Stream) -> Stream:
    return Stream(
        stream_id=stream.stream_id,
        device_index=stream.device_index,
        device_type=stream.device_type,
    )


class Event(torch.Event):
    """An npu event: completes when recorded (work runs synchronously)."""

    def __new__(
        cls,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        device: _device_t = None,
    ) -> "Event":
        index = _device_index(device)
        return super().__new__(
            cls,
            device=torch.device("npu", index),
            enable_timing=enable_timing,
            blocking=blocking,
            interprocess=interprocess,
        )

    def record(self, stream: torch.Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        super().record(stream)
        audit = _audit.active()
        if audit is not None:
            audit.stream_order.record_event(self.event_id, _audit._stream_key(stream))

    def wait(self, stream: torch.Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        super().wait(stream)
        audit = _audit.active()
        if audit is not None:
            audit.stream_order.wait_event(_audit._stream_key(stream), self.event_id)

    def synchronize(self) -> None:
        super().synchronize()
        audit = _audit.active()
        if audit is not None:
            audit.sync("synchronize", "Event.synchronize")
            audit.stream_order.host_waits_for_event(self.event_id)

    def elapsed_time(self, end_event: torch.Event) -> float:
        # torch.Event.elapsed_time accepts only exact torch.Event instances.
        return float(torch.ops.npu_sim.event_elapsed_time(self.event_id, end_event.event_id))


def current_stream(device: _device_t = None) -> Stream:
    return _as_npu_stream(torch.accelerator.current_stream(_device_index(device)))


def default_stream(device: _device_t = None) -> Stream:
    index = _device_index(device)
    # torch.Stream names device types by their c10 enum value.
    device_type = torch.accelerator.current_stream(index).device_type
    return Stream(stream_id=0, device_index=index, device_type=device_type)


def set_stream(stream: torch.Stream | None) -> None:
    if stream is None:
        return
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None) -> Iterator[None]:
    """Make ``stream`` current for the block (None: leave the current stream alone)."""
    if stream is None:
        yield
        return
    previous = torch.accelerator.current_stream(stream.device_index)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


StreamContext = stream


# -- random numbers -----------------------------------------------------------
#
# Every npu device's default generator draws from the CPU default generator's
# stream (see README: RNG parity). Seeding an npu generator therefore reseeds
# the CPU default generator too.


def _default_generator(index: int) -> torch.Generator:
    return torch._C._accelerator_getDefaultGenerator(index)


class _DefaultGenerators:
    """Sequence view of the per-device default generators (like torch.cuda.default_generators)."""

    def __len__(self) -> int:
        return device_count()

    def __getitem__(self, index: int) -> torch.Generator:
        return _default_generator(_device_index(index))

    def __iter__(self) -> Iterator[torch.Generator]:
        return (_default_generator(i) for i in range(device_count()))


default_generators = _DefaultGenerators()


def manual_seed(seed: int) -> None:
    _default_generator(current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    # All devices share one stream: seeding it once seeds them all.
    manual_seed(seed)


def seed() -> None:
    _default_generator(current_device()).seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return _default_generator(current_device()).initial_seed()


def get_rng_state(device: _device_t = "npu") -> torch.Tensor:
    """16 bytes: uint64 seed, int64 offset (32-bit words drawn since seeding)."""
    return _default_generator(_device_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device: _device_t = "npu") -> None:
    _default_generator(_device_index(device)).set_state(new_state.to("cpu"))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


# -- memory -------------------------------------------------------------------


def memory_stats(device: _device_t = None) -> "OrderedDict[str, Any]":
    """CUDA-style flat statistics ("allocated_bytes.all.current", ...) from the allocator."""
    return torch.accelerator.memory_stats(_device_index(device))


def memory_allocated(device: _device_t = None) -> int:
    return torch.accelerator.memory_allocated(_device_index(device))


def max_memory_allocated(device: _device_t = None) -> int:
    return torch.accelerator.max_memory_allocated(_device_index(device))


def memory_reserved(device: _device_t = None) -> int:
    return torch.accelerator.memory_reserved(_device_index(device))


def max_memory_reserved(device: _device_t = None) -> int:
    return torch.accelerator.max_memory_reserved(_device_index(device))


def reset_peak_memory_stats(device: _device_t = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_device_index(device))


def reset_max_memory_allocated(device: _device_t = None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: _device_t = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_device_index(device))


def check_uce_in_memory(device: _device_t = None) -> int:
    """torch_npu's UCE query: where the last device memory error lies (0 none, 1 outside the pool, 2 temporary
    memory, 3 the job's state). The simulated device has no memory errors: always 0."""
    _device_index(device)
    return 0


def stop_device(device: _device_t = None) -> int:
    """torch_npu's stop of a device's tasks (aclrtDeviceTaskAbort): 0 on success. The simulated device runs each
    task at launch in the calling thread, so nothing is queued for a stop to drop, and a collective blocked on a
    peer ends when its process group is aborted."""
    _device_index(device)
    return 0


def restart_device(device: _device_t = None) -> None:
    """torch_npu's recovery after a UCE or stop_device (repair, then resume the device's task queue). The
    simulated device stops no tasks: nothing to resume."""
    _device_index(device)


def empty_cache() -> None:
    """No cache to empty: freed device memory returns to the host at once."""


def mem_get_info(device: _device_t = None) -> tuple[int, int]:
    """(free, total) bytes of the simulated device."""
    return torch.accelerator.get_memory_info(_device_index(device))


def host_memory_stats() -> dict[str, int]:
    """Pinned host memory handed out by the simulator's pinned allocator."""
    current, peak, blocks = torch.ops.npu_sim.pinned_memory_stats()
    return {
        "pinned_bytes.current": int(current),
        "pinned_bytes.peak": int(peak),
        "pinned_blocks.current": int(blocks),
    }


def memory_summary(device: _device_t = None, abbreviated: bool = False) -> str:
    index = _device_index(device)
    stats = memory_stats(index)
    return (
        f"npu:{index} ({DEVICE_NAME}) allocated {stats['allocated_bytes.all.current']} B, "
        f"peak {stats['allocated_bytes.all.peak']} B, "
        f"capacity {torch.ops.npu_sim.capacity_bytes()} B, OOMs {stats['num_ooms']}"
    )


from torch_npu import _memory_history as memory  # noqa: E402  (torch.npu.memory: snapshot API stand-in)

# torch.npu._recovery: torch_npu's is a submodule of its npu package; this torch.npu is one file, so the import
# system finds the stand-in under that name here.
from torch_npu import _recovery  # noqa: E402
import sys as _sys  # noqa: E402

_sys.modules[f"{__name__}._recovery"] = _recovery
