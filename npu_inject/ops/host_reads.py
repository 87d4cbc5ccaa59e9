"""Device tensors read on the host: one device-to-host copy per tensor, shared by every reader.

On an NPU each read of device data by the host is a copy and a stream synchronisation, which stalls
the launch queue. Some small tensors are read by several parts of one forward: the position ids of a
packed batch give the attention kernel its document lengths (which torch_npu takes as host ints) and
RoPE's bounds check. :func:`host_copy` copies such a tensor once and hands the same host copy to the
later readers. Where the host already had the values -- the batch torchtitan copied to the device --
:func:`remember` records that host tensor beside its device copy, and no reader copies anything back.

An entry is the tensor's storage address, view and version counter, and keeps the tensor alive: while
it is cached no other tensor can take its memory, and any in-place write (the version moves) misses.
An in-place write to the host copy misses too (its version is kept beside it). Only the latest few
tensors are kept (a step's batch and positions, then the next step's).
"""

from __future__ import annotations

import collections

import torch

_CACHED = 32  # a step's batch tensors (per microbatch under pipeline parallelism) and their readers' copies
_cache: collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = collections.OrderedDict()


def _key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.dtype, tensor._version)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host: itself when it is there, else one copy per tensor and version (see above)."""
    if tensor.device.type == "cpu":
        return tensor
    key = _key(tensor)
    hit = _cache.get(key)
    if hit is not None and hit[1]._version == hit[2]:
        _cache.move_to_end(key)
        return hit[1]
    copy = _to_host(tensor)
    _store(key, tensor, copy)
    return copy


def remember(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    """Record that ``host_tensor`` holds ``device_tensor``'s values (it was copied from it, just now)."""
    if device_tensor.device.type == "cpu" or host_tensor.device.type != "cpu":
        return
    if host_tensor.shape != device_tensor.shape or host_tensor.dtype != device_tensor.dtype:
        raise ValueError(f"host_reads.remember: host tensor {tuple(host_tensor.shape)} {host_tensor.dtype} does "
                         f"not hold device tensor {tuple(device_tensor.shape)} {device_tensor.dtype}")
    _store(_key(device_tensor), device_tensor, host_tensor)


def _store(key: tuple, tensor: torch.Tensor, copy: torch.Tensor) -> None:
    _cache[key] = (tensor, copy, copy._version)
    _cache.move_to_end(key)
    while len(_cache) > _CACHED:
        _cache.popitem(last=False)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    # Out of sight of dispatch modes: selective activation checkpointing records a region's ops and hands
    # their saved outputs back by order when it recomputes; a copy made in the forward but served from this
    # cache in the recomputation would shift that order (a host tensor handed to a later device op).
    with torch.utils._python_dispatch._disable_current_modes():
        return tensor.detach().to("cpu")  # the one device-to-host copy (and stream synchronisation)


def clear() -> None:
    """Forget every cached copy (a patch's revert, tests)."""
    _cache.clear()
