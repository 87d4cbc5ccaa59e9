"""Pinned host memory with the simulated npu as the accelerator."""

from __future__ import annotations

import torch


def test_empty_with_pin_memory_is_pinned() -> None:
    pinned = torch.empty(16, pin_memory=True)
    assert pinned.is_pinned()
    assert pinned[4:].is_pinned()  # a pointer inside a pinned block
    assert not torch.empty(16).is_pinned()


def test_pin_memory_copies_into_pinned_storage() -> None:
    source = torch.randn(8)
    pinned = source.pin_memory()
    assert pinned.is_pinned()
    assert not source.is_pinned()
    assert torch.equal(pinned, source)


def test_pinned_bytes_are_counted_and_released() -> None:
    before = torch.npu.host_memory_stats()["pinned_bytes.current"]
    pinned = torch.empty(256, pin_memory=True)
    assert torch.npu.host_memory_stats()["pinned_bytes.current"] - before == 256 * 4
    del pinned
    assert torch.npu.host_memory_stats()["pinned_bytes.current"] == before


def test_non_blocking_copies_through_pinned_memory() -> None:
    source = torch.randn(4, 4).pin_memory()
    on_device = source.to("npu", non_blocking=True)
    back = torch.empty(4, 4, pin_memory=True)
    back.copy_(on_device, non_blocking=True)
    torch.npu.current_stream().synchronize()
    assert torch.equal(back, source)


def test_device_tensors_cannot_be_pinned() -> None:
    assert not torch.ones(2, device="npu").is_pinned()
