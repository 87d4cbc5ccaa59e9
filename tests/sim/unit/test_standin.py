"""The torch_npu stand-in package: identity, device module, forwarded ops."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types

import pytest
import torch

import torch_npu


def test_identity() -> None:
    assert torch_npu.__simulated__ is True
    assert torch_npu.__version__ == "2.14.0"
    assert importlib.metadata.version("torch_npu") == "2.14.0"
    assert torch_npu.npu is torch.npu
    assert torch.get_device_module("npu") is torch.npu
    assert torch_npu.distributed.is_hccl_available()


def test_device_module_reports_configuration() -> None:
    expected_devices = int(os.environ.get("TORCHTITAN_NPU_SIM_DEVICES", "8"))
    expected_gb = float(os.environ.get("TORCHTITAN_NPU_SIM_MEMORY_GB", "64"))
    assert torch.npu.is_available()
    assert torch.npu.device_count() == expected_devices
    assert torch.npu.get_device_name() == "Ascend910B-sim"
    properties = torch.npu.get_device_properties(0)
    assert properties.name == "Ascend910B-sim"
    assert properties.total_memory == int(expected_gb * (1 << 30))
    assert torch.npu.is_bf16_supported()
    assert isinstance(torch.npu.get_device_capability(), tuple)


def test_hccl_is_the_npu_default_backend() -> None:
    import torch.distributed as dist

    assert dist.Backend.default_device_backend_map["npu"] == "hccl"
    assert "npu" in dist.Backend.backend_capability["hccl"]


def test_reference_ops_are_forwarded_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels are npu:: operators (with fakes, for torch.compile) computed by the reference
    # family module, looked up per call.
    fake = types.ModuleType("npu_inject.ops.reference.grouped_matmul")
    fake.npu_grouped_matmul = lambda x, weight, **kwargs: [x[0] * 2]
    monkeypatch.setitem(sys.modules, "npu_inject.ops.reference.grouped_matmul", fake)
    (y,) = torch_npu.npu_grouped_matmul([torch.ones(2, 3, device="npu")], [torch.ones(1, 3, 4, device="npu")],
                                        group_list=torch.tensor([2], device="npu"), split_item=3)
    assert torch.equal(y.cpu(), torch.full((2, 3), 2.0))
    from torch_npu import _reference_ops

    with pytest.raises(NotImplementedError, match="npu_not_a_kernel"):
        _reference_ops._reference("npu_not_a_kernel")


def test_autocast_on_npu() -> None:
    a = torch.randn(4, 4, device="npu")
    with torch.autocast(device_type="npu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16


def test_dtensor_random_ops_default_to_rehearsal_semantics() -> None:
    from torch.distributed.tensor import _random as dtensor_random

    assert os.environ.get("TORCHTITAN_NPU_SIM_DTENSOR_RNG", "local") == "local"
    assert dtensor_random._rng_tracker is not None
    assert dtensor_random._rng_tracker.distribute_region_enabled is False


def test_fusion_attention_v3_reads_its_lengths_from_the_host_and_compiles_with_its_fake() -> None:
    """torch_npu reads v3's actual_seq_qlen/kvlen on the host (a device tensor is rejected, as
    op-plugin's "tensor must be on CPU"); npu::npu_fusion_attention_v3 has a fake, so a compiled call
    traces it as one op and the document count stays a dynamic input, not a constant of the graph."""
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="npu"), diagonal=1)
    q, k, v = (torch.randn(12, heads, 8, device="npu") for heads in (4, 2, 2))

    def attention(q, k, v, ends):
        return torch_npu.npu_fusion_attention_v3(q, k, v, 4, "TND", atten_mask=mask, sparse_mode=3,
                                                 actual_seq_qlen=ends, actual_seq_kvlen=ends)[0]

    eager = attention(q, k, v, torch.tensor([5, 12]))
    assert eager.device.type == "npu" and eager.shape == (12, 4, 8)
    with pytest.raises(ValueError, match="actual_seq_qlen must be a 1-D CPU integer tensor"):
        attention(q, k, v, torch.tensor([5, 12], device="npu"))
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(attention, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(q, k, v, torch.tensor([5, 12])).cpu(), eager.cpu())
    # At least two documents, as with two batch rows: dynamo specializes a size of 1 (a third graph).
    for ends in ([3, 7, 12], [6, 12], [1, 2, 3, 12]):
        compiled(q, k, v, torch.tensor(ends))
    assert len(graphs) == 2  # static, then a dynamic document count
    assert any("npu_fusion_attention_v3" in str(node.target) for node in graphs[0].graph.nodes)
