"""Rank program: FSDP2 training and a DCP round trip on 2 simulated NPUs.

argv: <checkpoint directory shared by the ranks>. Rank 0 also trains the same
model in-process on the CPU without FSDP (the 1-process reference) and checks
losses and parameters against the sharded npu run.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import torch_npu

STEPS = 3
TOLERANCE = 1e-5
GLOBAL_BATCH = 8


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 4),
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, 4, generator=generator))
        for _ in range(STEPS + 1)
    ]


def train_step(model, optimizer, inputs, targets) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def reference_run(data) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The 1-process CPU run: same init, full batches."""
    model = make_model(seed=0)
    optimizer = make_optimizer(model)
    losses = [train_step(model, optimizer, x, y).item() for x, y in data[:STEPS]]
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    next_loss = train_step(model, optimizer, *data[STEPS]).item()
    return losses, params, next_loss


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model.to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
    checkpoint_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = torch.device("npu", rank)
    torch.npu.set_device(device)
    dist.init_process_group("hccl", device_id=device)

    data = batches()
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)

    model = shard(make_model(seed=0), device)
    optimizer = make_optimizer(model)
    check(all(p.device == device for p in model.parameters()), "parameters are not on the npu")
    losses = []
    for x, y in data[:STEPS]:
        local = train_step(model, optimizer, x[rows].to(device), y[rows].to(device))
        dist.all_reduce(local, op=dist.ReduceOp.AVG)
        losses.append(local.item())

    full_params = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    peak = torch.npu.max_memory_allocated(device)
    check(0 < torch.npu.memory_allocated(device) <= peak, "device memory accounting is inconsistent")

    if rank == 0:
        ref_losses, ref_params, _ = reference_run(data)
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            check(abs(got - want) <= TOLERANCE, f"step {step}: FSDP2 loss {got} != CPU loss {want}")
        for name, want in ref_params.items():
            got = full_params[name]
            check(torch.allclose(got, want, atol=TOLERANCE, rtol=0), f"{name} differs by {(got - want).abs().max()}")

    # DCP round trip: save model + optimizer, load into a differently initialised copy.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)

    restored = shard(make_model(seed=99), device)
    restored_optimizer = make_optimizer(restored)
    train_step(restored, restored_optimizer, data[0][0][rows].to(device), data[0][1][rows].to(device))
    target_model_sd, target_optim_sd = get_state_dict(restored, restored_optimizer)
    state = {"model": target_model_sd, "optim": target_optim_sd}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(
        restored, restored_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for name, p in restored.named_parameters():
        check(torch.equal(p.full_tensor().cpu(), full_params[name]), f"DCP restored {name} differently")

    # The restored optimizer state must continue training exactly like the original.
    x, y = data[STEPS]
    original_next = train_step(model, optimizer, x[rows].to(device), y[rows].to(device))
    restored_next = train_step(restored, restored_optimizer, x[rows].to(device), y[rows].to(device))
    check(torch.equal(original_next.cpu(), restored_next.cpu()), "restored model trains differently")
    dist.all_reduce(original_next, op=dist.ReduceOp.AVG)
    if rank == 0:
        _, _, ref_next = reference_run(data)
        check(abs(original_next.item() - ref_next) <= TOLERANCE, "step after DCP differs from CPU")

    check_dtensor_random_like_rehearsal(world, device)

    dist.destroy_process_group()
    print(f"rank {rank}: fsdp2+dcp ok, losses {losses}")


def check_dtensor_random_like_rehearsal(world: int, device: torch.device) -> None:
    """Default "local" mode: a random op on a sharded DTensor draws each rank's
    shard from the seeded default stream, as DTensor does on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import _random as dtensor_random

    mesh = init_device_mesh("npu", (world,))
    dtensor_random.manual_seed(5, mesh)
    sharded = distribute_tensor(torch.empty(8, 3, device=device), mesh, [Shard(0)])
    torch.nn.init.normal_(sharded)
    torch.manual_seed(5)
    expected = torch.empty(8 // world, 3).normal_()
    check(torch.equal(sharded.to_local().cpu(), expected), "DTensor shard differs from the CPU draw")


if __name__ == "__main__":
    main()
