"""Device memory accounting of the simulated npu allocator."""

from __future__ import annotations

import pytest
import torch

FLOAT_BYTES = 4


def allocated(device: int = 0) -> int:
    return torch.npu.memory_allocated(device)


def test_allocate_and_free_counts_exact_bytes() -> None:
    before = allocated()
    tensor = torch.empty(1000, device="npu")
    assert allocated() - before == 1000 * FLOAT_BYTES
    del tensor
    assert allocated() == before


def test_peak_tracks_maximum_and_resets() -> None:
    torch.npu.reset_peak_memory_stats()
    base = allocated()
    first = torch.empty(256, device="npu")
    second = torch.empty(512, device="npu")
    del first, second
    assert allocated() == base
    assert torch.npu.max_memory_allocated() == base + 768 * FLOAT_BYTES
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == base


def test_memory_stats_use_cuda_style_keys_and_agree() -> None:
    tensor = torch.ones(100, device="npu")
    stats = torch.npu.memory_stats()
    for key in (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "active_bytes.all.current",
        "active_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "num_alloc_retries",
        "num_ooms",
    ):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] == torch.npu.memory_allocated()
    assert stats["reserved_bytes.all.current"] == torch.npu.memory_reserved()
    assert torch.npu.memory_reserved() == torch.npu.memory_allocated()  # no caching
    assert torch.npu.max_memory_reserved() >= torch.npu.memory_reserved()
    assert torch.accelerator.memory_allocated(0) == torch.npu.memory_allocated(0)
    del tensor


def test_kernel_outputs_are_device_allocations() -> None:
    a = torch.ones(64, device="npu")
    b = torch.ones(64, device="npu")
    before = allocated()
    c = a + b  # produced by the CPU fallback, adopted as device memory
    assert allocated() - before == 64 * FLOAT_BYTES
    del c
    assert allocated() == before


def test_accounting_is_per_device() -> None:
    before = [allocated(0), allocated(1)]
    tensor = torch.empty(10, device="npu:1")
    assert allocated(1) - before[1] == 10 * FLOAT_BYTES
    assert allocated(0) == before[0]
    moved = tensor.to("npu:0")
    assert allocated(0) - before[0] == 10 * FLOAT_BYTES
    del tensor, moved


def test_tensor_resize_grows_storage_and_never_shrinks_it() -> None:
    before = allocated()
    tensor = torch.ones(100, device="npu")
    tensor.resize_(300)
    assert allocated() - before == 300 * FLOAT_BYTES
    assert torch.equal(tensor[:100].cpu(), torch.ones(100))  # old contents kept
    tensor.resize_(10)  # like CUDA: the storage keeps its size
    assert allocated() - before == 300 * FLOAT_BYTES
    del tensor
    assert allocated() == before


def test_storage_resize_to_zero_and_back_like_fsdp2() -> None:
    before = allocated()
    flat = torch.zeros(1000, device="npu")
    param_view = flat[100:200].view(10, 10)  # FSDP2 keeps views into the unsharded storage
    storage = flat.untyped_storage()
    storage.resize_(0)
    assert allocated() == before
    assert storage.size() == 0
    storage.resize_(1000 * FLOAT_BYTES)
    assert allocated() - before == 1000 * FLOAT_BYTES
    flat.copy_(torch.arange(1000, dtype=torch.float32))
    assert torch.equal(param_view.cpu(), torch.arange(100, 200, dtype=torch.float32).view(10, 10))
    del flat, param_view, storage
    assert allocated() == before


def test_out_of_memory_is_raised_and_counted() -> None:
    capacity = torch.ops.npu_sim.capacity_bytes()
    devices = torch.npu.device_count()
    ooms = torch.npu.memory_stats()["num_ooms"]
    torch.ops.npu_sim.configure(devices, allocated() + 1024)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="NPU out of memory"):
            torch.empty(1024, device="npu")
    finally:
        torch.ops.npu_sim.configure(devices, capacity)
    assert torch.npu.memory_stats()["num_ooms"] == ooms + 1


def test_mem_get_info_reports_capacity_minus_allocated() -> None:
    free, total = torch.npu.mem_get_info()
    assert total == torch.npu.get_device_properties(0).total_memory
    assert free == total - allocated()
