"""Random numbers on the npu draw from the CPU default generator's stream."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint


def draw_all(device: str) -> list[torch.Tensor]:
    return [
        torch.randn(5, 7, device=device),
        torch.rand(3, device=device),
        torch.randn(100, device=device),
        torch.randint(0, 10, (20,), device=device),
        torch.randperm(12, device=device),
        torch.nn.functional.dropout(torch.ones(64, device=device), p=0.5),
        torch.empty(33, device=device).normal_(2.0, 3.0),
        torch.bernoulli(torch.full((40,), 0.3, device=device)),
    ]


def test_manual_seed_gives_cpu_identical_values() -> None:
    torch.manual_seed(1234)
    on_npu = draw_all("npu")
    torch.manual_seed(1234)
    on_cpu = draw_all("cpu")
    for npu_tensor, cpu_tensor in zip(on_npu, on_cpu):
        assert npu_tensor.device.type == "npu"
        assert torch.equal(npu_tensor.cpu(), cpu_tensor)


def test_npu_manual_seed_seeds_the_shared_stream() -> None:
    torch.npu.manual_seed(7)
    first = torch.randn(10, device="npu")
    torch.npu.manual_seed_all(7)
    assert torch.equal(torch.randn(10, device="npu"), first)
    assert torch.npu.initial_seed() == 7


def test_rng_state_is_philox_shaped_and_round_trips() -> None:
    torch.manual_seed(5)
    torch.randn(50, device="npu")
    state = torch.npu.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16 and state.device.type == "cpu"
    assert state[:8].view(torch.uint64).item() == 5
    assert state[8:].view(torch.int64).item() > 0
    expected = torch.randn(2000, device="npu")
    torch.npu.set_rng_state(state)
    assert torch.equal(torch.randn(2000, device="npu").cpu(), expected.cpu())
    assert len(torch.npu.get_rng_state_all()) == torch.npu.device_count()


def test_rng_state_rejects_foreign_layouts() -> None:
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.npu.set_rng_state(torch.get_rng_state())


def test_fork_rng_on_npu_restores_the_stream() -> None:
    torch.manual_seed(11)
    with torch.random.fork_rng(devices=[0], device_type="npu"):
        torch.randn(100, device="npu")
    after_fork = torch.randn(10, device="npu")
    torch.manual_seed(11)
    assert torch.equal(after_fork.cpu(), torch.randn(10, device="npu").cpu())


def test_explicit_npu_generator_is_independent_and_reproducible() -> None:
    generator = torch.Generator(device="npu")
    assert generator.device == torch.device("npu", 0)
    generator.manual_seed(3)
    first = torch.randn(8, device="npu", generator=generator)
    generator.manual_seed(3)
    assert torch.equal(torch.randn(8, device="npu", generator=generator), first)
    reference = torch.Generator().manual_seed(3)
    assert torch.equal(first.cpu(), torch.randn(8, generator=reference))


def test_activation_checkpoint_replays_dropout() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).npu()
    inputs = torch.randn(4, 16, device="npu", requires_grad=True)

    torch.manual_seed(1)
    layer(inputs).sum().backward()
    plain = inputs.grad.clone()
    inputs.grad = None

    torch.manual_seed(1)
    torch.utils.checkpoint.checkpoint(layer, inputs, use_reentrant=False).sum().backward()
    assert torch.equal(inputs.grad.cpu(), plain.cpu())
