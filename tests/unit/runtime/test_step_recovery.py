"""step_recovery.reset_fsdp: a step cut after a backward without gradient sync (a pipeline schedule's earlier
microbatches) leaves FSDP holding that microbatch's unreduced gradients; the retry must not count them again.

Checked on two gloo ranks against plain autograd on the whole model (no FSDP): the retried step's gradients equal
the mean of the two ranks' batch gradients."""

from __future__ import annotations

import torch

from gloo import run_on_gloo_ranks

DIM = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, 1))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 + rank))


def _worker(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from npu_inject.step_recovery import fsdp_settings, reset_fsdp, unsynced_gradients

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    batch = _batch(rank)
    settings = fsdp_settings([model])
    before = unsynced_gradients([model])
    # The cut attempt: one microbatch's backward without gradient sync (as torch's pipeline schedule runs every
    # backward before the last), then the fault.
    model.set_requires_gradient_sync(False)
    model(batch).sum().backward()
    held = unsynced_gradients([model])
    model.set_requires_gradient_sync(True)
    reset_fsdp([model], settings)
    after_reset = unsynced_gradients([model])
    # The retry: the whole step again, synced.
    for parameter in model.parameters():
        parameter.grad = None
    model(batch).sum().backward()
    grads = {name: parameter.grad.full_tensor() for name, parameter in model.named_parameters()}
    return {"before": before, "held": held, "after_reset": after_reset, "grads": grads}


def test_reset_fsdp_drops_the_cut_steps_unreduced_gradients():
    results = run_on_gloo_ranks(_worker, 2)
    reference = _model()
    loss = sum(reference(_batch(rank)).sum() for rank in range(2)) / 2  # FSDP averages over the ranks
    loss.backward()
    expected = {name: parameter.grad for name, parameter in reference.named_parameters()}
    for rank, result in results.items():
        assert result["before"] == 0
        assert result["held"] > 0  # the cut backward's gradients wait unreduced
        assert result["after_reset"] == 0
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected[name], msg=f"rank {rank} {name}")
