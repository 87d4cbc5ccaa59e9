"""Training on the simulated npu reproduces the CPU numbers."""

from __future__ import annotations

import torch

import torch_npu


def train(device: str, optimizer_class) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    ).to(device)
    # foreach explicitly: torch defaults to it on accelerators (npu included)
    # but not on cpu, and the two paths round differently in the last bit.
    optimizer = optimizer_class(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    inputs = torch.randn(16, 8, device=device)
    targets = torch.randint(0, 4, (16,), device=device)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_mlp_forward_backward_adamw_matches_cpu() -> None:
    cpu_losses, cpu_params = train("cpu", torch.optim.AdamW)
    npu_losses, npu_params = train("npu", torch.optim.AdamW)
    assert npu_losses == cpu_losses
    for npu_param, cpu_param in zip(npu_params, cpu_params):
        torch.testing.assert_close(npu_param, cpu_param, rtol=0, atol=0)


def test_npu_fused_adamw_has_adamw_semantics() -> None:
    cpu_losses, cpu_params = train("cpu", torch.optim.AdamW)
    fused_losses, fused_params = train("npu", torch_npu.optim.NpuFusedAdamW)
    assert fused_losses == cpu_losses
    for fused, reference in zip(fused_params, cpu_params):
        torch.testing.assert_close(fused, reference, rtol=0, atol=0)


def test_gradients_live_on_the_npu() -> None:
    weight = torch.randn(3, 3, device="npu", requires_grad=True)
    (weight @ weight).sum().backward()
    assert weight.grad.device == torch.device("npu", 0)
