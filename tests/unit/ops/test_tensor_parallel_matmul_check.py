"""Tensor-parallel linears (DTensors) checked on their local shards, against DTensor's own ``F.linear``.

One process as rank 0 of two (torch's fake process group: collectives do nothing, which is all the local products
need). For each layout torchtitan's DTensor backends give a linear, the checked call must return what DTensor's
``F.linear`` returns (placements, shape, local values bit for bit) and leave the same gradients (placements and
local values) on the input and the weight, with its three products checked. The products across ranks are
checked in ``tests/e2e/test_matmul_checks.py`` (TP 2, FSDP 2 x TP 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from npu_inject.ops.matmul_check import Ledger, tensor_parallel_layout


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _dtensor(full: torch.Tensor, mesh, placement) -> DTensor:
    local = full if placement.is_replicate() else full.chunk(2, placement.dim)[0]
    return DTensor.from_local(local.clone(), mesh, (placement,)).detach().requires_grad_()


LAYOUTS = {
    "column-wise": (Replicate(), Shard(0), ((Shard(2),), (Partial(),), (Shard(0),))),
    "row-wise": (Shard(2), Shard(1), ((Partial(),), (Shard(2),), (Shard(1),))),
    "replicated": (Replicate(), Replicate(), ((Replicate(),), (Replicate(),), (Replicate(),))),
    "batch-sharded": (Shard(0), Replicate(), ((Shard(0),), (Shard(0),), (Partial(),))),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_tensor_parallel_linear_is_checked_on_its_shards_bit_for_bit_as_dtensor_computes_it(mesh, name):
    input_placement, weight_placement, expected_layout = LAYOUTS[name]
    torch.manual_seed(0)
    weight_full, input_full = torch.randn(16, 8), torch.randn(2, 6, 8)
    runs = []
    for checked in (True, False):
        weight, input = _dtensor(weight_full, mesh, weight_placement), _dtensor(input_full, mesh, input_placement)
        ledger = Ledger("cpu")
        layout = tensor_parallel_layout(input, weight)
        output = (ledger.linear_tensor_parallel(input, weight, layout) if checked
                  else torch.nn.functional.linear(input, weight))
        output.to_local().sum().backward()
        runs.append((output, input.grad, weight.grad, ledger.local_counts().tolist()))
    (output, input_grad, weight_grad, counts), (output_ref, input_grad_ref, weight_grad_ref, _) = runs
    assert layout == expected_layout
    assert output.placements == output_ref.placements and output.shape == output_ref.shape
    assert torch.equal(output.to_local(), output_ref.to_local())
    assert input_grad.placements == input_grad_ref.placements
    assert torch.equal(input_grad.to_local(), input_grad_ref.to_local())
    assert weight_grad.placements == weight_grad_ref.placements
    assert torch.equal(weight_grad.to_local(), weight_grad_ref.to_local())
    assert counts == [0.0, 0.0, 1.0, 1.0, 0.0]  # forward and backward checked, none failed


def test_a_corrupted_local_product_fails_its_check(mesh):
    torch.manual_seed(0)
    weight, input = _dtensor(torch.randn(16, 8), mesh, Shard(0)), _dtensor(torch.randn(2, 6, 8), mesh, Replicate())
    ledger = Ledger("cpu")
    ledger.corruption.fill_(1.0)
    output = ledger.linear_tensor_parallel(input, weight, tensor_parallel_layout(input, weight), corruptible=True)
    output.to_local().sum().backward()
    assert ledger.local_counts().tolist()[:3] == [1.0, 0.0, 1.0]


def test_a_layout_whose_local_products_are_not_the_product_is_not_checked(mesh):
    """Input sharded on its features, weight on its rows: the local product is not a shard of the result."""
    torch.manual_seed(0)
    weight, input = _dtensor(torch.randn(16, 8), mesh, Shard(0)), _dtensor(torch.randn(2, 6, 8), mesh, Shard(2))
    assert tensor_parallel_layout(input, weight) is None
    assert tensor_parallel_layout(input.to_local(), weight) is None
