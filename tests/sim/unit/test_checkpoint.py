"""DCP on the simulated npu in one process (the 2-rank FSDP2 case is in test_distributed)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


@pytest.fixture
def mixed_process_group():
    # Async save needs a CPU backend next to the device one, as torchtitan sets up.
    dist.init_process_group("cpu:gloo,npu:hccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_async_save_with_default_stager_round_trips(mixed_process_group, tmp_path) -> None:
    state = {"weight": torch.randn(32, 16, device="npu"), "step": torch.arange(4, device="npu")}
    options = StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
    )
    with warnings.catch_warnings():
        # Upstream's StateDictStager pins only when CUDA is available.
        warnings.filterwarnings("ignore", message="Ignoring pin_memory flag")
        stager = DefaultStager(options)
    try:
        response = dcp.async_save(state, checkpoint_id=str(tmp_path), async_stager=stager)
        response.upload_completion.result()
    finally:
        stager.close()
    restored = {"weight": torch.zeros(32, 16, device="npu"), "step": torch.zeros(4, dtype=torch.int64, device="npu")}
    dcp.load(restored, checkpoint_id=str(tmp_path))
    assert restored["weight"].device.type == "npu"
    assert torch.equal(restored["weight"].cpu(), state["weight"].cpu())
    assert torch.equal(restored["step"].cpu(), state["step"].cpu())
