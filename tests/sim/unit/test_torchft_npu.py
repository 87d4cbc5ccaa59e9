"""Patch torchft_npu on the simulated NPU: torchft's streams on npu, its HCCL group, apply and revert.

The failover itself (two replica groups, one killed, healed from the live one) is
tests/e2e/test_torchft.py's, on the simulated NPU and the CANN emulation.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")


@pytest.fixture
def applied(npu_patch):
    return npu_patch("torchft_npu")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_torchft_stream_helpers_use_the_npu_stream(applied):
    from torchft import manager, utils

    side = torch.Stream(device="npu")
    with utils.get_stream_context(side):
        assert torch.accelerator.current_stream() == side
    assert torch.accelerator.current_stream() != side
    assert manager.get_stream_context is utils.get_stream_context  # the names torchft's modules imported too
    utils.record_event()
    utils.synchronize()


def test_the_hccl_group_reduces_npu_tensors_aborts_and_is_rebuilt(applied):
    from npu_inject.patches.torchft_npu import make_process_group_class

    port = _free_port()
    address = f"127.0.0.1:{port}"
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    group = make_process_group_class()(timeout=timedelta(seconds=10))
    group.configure(f"{address}/quorum_1", "replica_0", 0, 1, quorum_id=1)
    assert group.getBackendName() == "torchft-hccl"
    tensor_N = torch.full((4,), 3.0, device="npu")
    group.allreduce([tensor_N], dist.AllreduceOptions()).wait()
    assert tensor_N.device.type == "npu" and tensor_N.cpu().tolist() == [3.0] * 4
    assert group.errored() is None

    group.abort()
    assert "aborted" in str(group.errored())
    group.configure(f"{address}/quorum_2", "replica_0", 0, 1, quorum_id=2)  # a new quorum: a new communicator
    assert group.errored() is None
    group.allreduce([tensor_N], dist.AllreduceOptions()).wait()
    assert tensor_N.cpu().tolist() == [3.0] * 4
    del store


def test_revert_restores_torchft(applied):
    from torchft import process_group, utils
    from torchtitan.experiments.torchft.manager import TorchFTManager

    assert utils.get_stream_context.__module__ == "npu_inject.patches.torchft_npu"
    applied.revert("torchft_npu")
    assert utils.get_stream_context.__module__ == "torchft.utils"
    assert process_group.synchronize is utils.synchronize
    assert TorchFTManager.__init__.__module__ == "torchtitan.experiments.torchft.manager"
