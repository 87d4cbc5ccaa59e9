"""Rank program: the simulated "hccl" backend's collectives on 2 npu ranks.

Launched by tests/sim/test_distributed.py with RANK/WORLD_SIZE/MASTER_* set.
Any failed check raises, so the rank exits non-zero.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

import torch_npu  # noqa: F401 - registers the simulated npu and "hccl"


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def main() -> None:
    # all_gather_into_tensor/reduce_scatter_tensor are deprecated aliases in
    # torch 2.14 but still what FSDP2-era code calls.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.npu.set_device(rank)
    device = torch.device("npu", rank)
    dist.init_process_group("hccl", device_id=device)
    check(dist.get_backend() == "hccl", f"backend is {dist.get_backend()}")

    # all_reduce: SUM, AVG, MAX, MIN.
    base = torch.arange(4, dtype=torch.float32, device=device) + rank
    for op, expected in [
        (dist.ReduceOp.SUM, torch.arange(4.0) * 2 + 1),
        (dist.ReduceOp.AVG, torch.arange(4.0) + 0.5),
        (dist.ReduceOp.MAX, torch.arange(4.0) + 1),
        (dist.ReduceOp.MIN, torch.arange(4.0)),
    ]:
        tensor = base.clone()
        dist.all_reduce(tensor, op=op)
        check(tensor.device == device, f"all_reduce moved the tensor to {tensor.device}")
        check(torch.equal(tensor.cpu(), expected), f"all_reduce {op}: {tensor.cpu()} != {expected}")

    premul = dist._make_nccl_premul_sum(2.0)
    try:
        dist.all_reduce(base.clone(), op=premul)
    except ValueError as error:
        check("PREMUL_SUM" in str(error), f"unexpected PREMUL_SUM error: {error}")
    else:
        raise AssertionError("PREMUL_SUM was accepted")

    # all_gather_into_tensor / all_gather.
    shard = torch.full((3,), float(rank), device=device)
    gathered = torch.empty(3 * world, device=device)
    dist.all_gather_into_tensor(gathered, shard)
    check(
        torch.equal(gathered.cpu(), torch.arange(world).repeat_interleave(3).float()),
        f"all_gather_into_tensor: {gathered.cpu()}",
    )
    pieces = [torch.empty(3, device=device) for _ in range(world)]
    dist.all_gather(pieces, shard)
    check(all(torch.equal(p.cpu(), torch.full((3,), float(i))) for i, p in enumerate(pieces)), "all_gather")

    # reduce_scatter_tensor (SUM and AVG, as FSDP2 uses it).
    full = torch.arange(2 * world, dtype=torch.float32, device=device) * (rank + 1)
    for op, scale in [(dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.AVG, 1.5)]:
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, full, op=op)
        expected = torch.arange(2 * world, dtype=torch.float32)[2 * rank : 2 * rank + 2] * scale
        check(torch.allclose(out.cpu(), expected), f"reduce_scatter_tensor {op}: {out.cpu()} != {expected}")

    # broadcast, barrier.
    value = torch.full((2, 2), float(rank + 7), device=device)
    dist.broadcast(value, src=1)
    check(torch.equal(value.cpu(), torch.full((2, 2), 8.0)), f"broadcast: {value.cpu()}")
    dist.barrier()

    # Object collectives move byte tensors to the current npu device.
    objects: list[object] = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "name": f"r{rank}"})
    check(objects == [{"rank": r, "name": f"r{r}"} for r in range(world)], f"all_gather_object: {objects}")
    payload = [{"step": 3}, "text"] if rank == 0 else [None, None]
    dist.broadcast_object_list(payload, src=0)
    check(payload == [{"step": 3}, "text"], f"broadcast_object_list: {payload}")

    # Point-to-point.
    if rank == 0:
        dist.send(torch.arange(5, dtype=torch.int64, device=device) * 10, dst=1)
        received = torch.empty(2, device=device)
        dist.recv(received, src=1)
        check(torch.equal(received.cpu(), torch.tensor([1.5, 2.5])), f"recv on 0: {received.cpu()}")
    else:
        received = torch.empty(5, dtype=torch.int64, device=device)
        dist.recv(received, src=0)
        check(torch.equal(received.cpu(), torch.arange(5) * 10), f"recv on 1: {received.cpu()}")
        dist.send(torch.tensor([1.5, 2.5], device=device), dst=0)

    # Crossing isend/irecv, as 1F1B issues them: both ranks send before they receive, so a
    # send that blocked until its peer's recv was posted would stall here.
    peer = 1 - rank
    incoming = torch.empty(4, device=device)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), rank + 1.0, device=device), peer),
                                    dist.P2POp(dist.irecv, incoming, peer)])
    for work in works:
        work.wait()
    works[-1].wait()  # a second wait returns at once
    check(torch.equal(incoming.cpu(), torch.full((4,), peer + 1.0)), f"crossing irecv on {rank}: {incoming.cpu()}")

    # Host tensors are not for hccl, as on a real NPU.
    try:
        dist.all_reduce(torch.ones(2))
    except (RuntimeError, ValueError) as error:
        check("cpu" in str(error).lower(), f"unexpected error for a host tensor: {error}")
    else:
        raise AssertionError("all_reduce of a host tensor on hccl succeeded")

    check_dtensor(rank, world, device)

    dist.destroy_process_group()
    print(f"rank {rank}: collectives ok")


def check_dtensor(rank: int, world: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import _random as dtensor_random

    mesh = init_device_mesh("npu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    sharded = distribute_tensor(full.to(device), mesh, [Shard(0)])
    check(sharded.to_local().device == device, f"local shard on {sharded.to_local().device}")
    check(torch.equal(sharded.to_local().cpu(), full[3 * rank : 3 * rank + 3]), "Shard(0) local piece")
    replicated = sharded.redistribute(mesh, [Replicate()])
    check(torch.equal(replicated.to_local().cpu(), full), "redistribute to Replicate")
    check(torch.equal(sharded.full_tensor().cpu(), full), "full_tensor")
    column = sharded.redistribute(mesh, [Shard(1)])
    check(torch.equal(column.to_local().cpu(), full[:, 2 * rank : 2 * rank + 2]), "Shard(0) -> Shard(1)")

    # With TORCHTITAN_NPU_SIM_DTENSOR_RNG=philox, DTensor's RNG tracker reads and
    # writes the npu generator's 16-byte Philox-shaped state; random ops on
    # DTensors must work and agree on replicated placements across ranks.
    check(os.environ.get("TORCHTITAN_NPU_SIM_DTENSOR_RNG") == "philox", "run this worker in philox mode")
    dtensor_random.manual_seed(7, mesh)
    check(
        isinstance(dtensor_random._rng_tracker, dtensor_random.OffsetBasedRNGTracker),
        f"DTensor RNG tracker is {dtensor_random._rng_tracker!r}",
    )
    noise = distribute_tensor(torch.empty(8, 4, device=device), mesh, [Replicate()])
    torch.nn.init.normal_(noise)
    gathered = [torch.empty(8, 4, device=device) for _ in range(world)]
    dist.all_gather(gathered, noise.to_local())
    check(torch.equal(gathered[0].cpu(), gathered[1].cpu()), "replicated random DTensor differs across ranks")
    sharded_noise = distribute_tensor(torch.empty(8, 4, device=device), mesh, [Shard(0)])
    torch.nn.init.uniform_(sharded_noise)
    halves = sharded_noise.full_tensor().cpu()
    check(not torch.equal(halves[:4], halves[4:]), "sharded random DTensor repeats across shards")


if __name__ == "__main__":
    main()
