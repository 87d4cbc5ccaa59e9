"""One rank of tests/cann_emu/test_hccl.py, started by torchrun in the CANN emulation's venv.

    torchrun --standalone --nproc-per-node N tests/cann_emu/hccl_worker.py MODE OUT_DIR

Runs torch_npu's own ProcessGroupHCCL (``backend="hccl"``, tensors on ``npu``) and writes
OUT_DIR/rank<R>.json: per check ``true`` or what differed. Expected values are plain CPU PyTorch
math on inputs every rank can make (seeded per rank). Tensors are made on the CPU and moved with
``.npu()``: the emulation has few aclnn operators yet.

MODE ``collectives``: every collective; ``exit``: after one all_reduce the last rank exits and the
others try a second; ``hang``: the same, but the last rank stays alive without joining; ``stop``: as
``hang``, and the others stop the device's tasks (torch_npu's stop_device) and restart it;
``stop_while_waiting``: as ``stop`` with CANN_EMU_ASYNC_STREAMS=1, the stop made by another Python thread while
the host waits; a communicator idle at the stop refuses calls until resumed, the one whose call was cut cannot be. In ``exit``/``hang``/``stop*`` every rank exits 0 after writing its result, so torchrun waits for all of them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
results: dict[str, object] = {}


def inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input for one check, on the CPU: the same list on every rank."""
    out = []
    for r in range(WORLD):
        g = torch.Generator().manual_seed(1000 * seed + r)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        elif dtype == torch.uint8:
            out.append(torch.randint(0, 20, shape, generator=g).to(dtype))
        else:
            out.append(torch.randint(-20, 20, shape, generator=g).to(dtype))
    return out


def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    got = got.cpu()
    ok = got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    results[name] = True if ok else f"got {got.tolist()}, expected {expected.tolist()}"


def fold(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' tensors reduced in rank order: float32 for floating types (the emulation's fp16/bf16
    are widened and rounded once), int64 for integers (wrapping at the final cast)."""
    acc = [x.to(torch.float32 if x.dtype.is_floating_point else torch.int64) for x in xs]
    out = acc[0]
    for x in acc[1:]:
        out = {"sum": out + x, "max": torch.maximum(out, x), "min": torch.minimum(out, x), "product": out * x}[op]
    return out.to(xs[0].dtype)


def collectives() -> None:
    seed = 0
    cases = [("sum", dt) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8)]
    cases += [("max", torch.float32), ("max", torch.bfloat16), ("min", torch.float32), ("product", torch.float32)]
    for op, dt in cases:
        seed += 1
        xs = inputs(seed, (3, 5), dt)
        t = xs[RANK].npu()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
        check(f"all_reduce_{op}_{str(dt).removeprefix('torch.')}", t, fold(op, xs))

    seed += 1
    src = WORLD - 1
    xs = inputs(seed, (4, 2), torch.float32)
    t = (xs[RANK] if RANK == src else torch.zeros(4, 2)).npu()
    dist.broadcast(t, src=src)
    check("broadcast", t, xs[src])

    for dt in (torch.float32, torch.uint8):
        seed += 1
        xs = inputs(seed, (4, 3), dt)
        out = torch.zeros(WORLD * 4, 3, dtype=dt).npu()
        dist.all_gather_into_tensor(out, xs[RANK].npu())
        check(f"all_gather_into_tensor_{str(dt).removeprefix('torch.')}", out, torch.cat(xs))

    seed += 1
    xs = inputs(seed, (WORLD * 2, 3), torch.float32)
    out = torch.zeros(2, 3).npu()
    dist.reduce_scatter_tensor(out, xs[RANK].npu())
    check("reduce_scatter_tensor", out, fold("sum", xs)[RANK * 2:(RANK + 1) * 2])

    # all_to_all_single, uneven: rank i sends i + j + 1 rows to rank j; row k of it holds 100 i + 10 j + k.
    def rows(i: int, j: int) -> torch.Tensor:
        return torch.stack([torch.full((2,), 100.0 * i + 10 * j + k) for k in range(i + j + 1)])

    expected = torch.cat([rows(i, RANK) for i in range(WORLD)])
    out = torch.zeros_like(expected).npu()
    dist.all_to_all_single(out, torch.cat([rows(RANK, j) for j in range(WORLD)]).npu(),
                           output_split_sizes=[i + RANK + 1 for i in range(WORLD)],
                           input_split_sizes=[RANK + j + 1 for j in range(WORLD)])
    check("all_to_all_single_uneven", out, expected)

    # send/recv around the ring (even ranks send first), then the same as one batch_isend_irecv.
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    mine = torch.arange(6, dtype=torch.float32) + 10 * RANK
    got = torch.zeros(6).npu()
    if RANK % 2 == 0:
        dist.send(mine.npu(), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(mine.npu(), dst=nxt)
    check("send_recv_ring", got, torch.arange(6, dtype=torch.float32) + 10 * prv)
    got = torch.zeros(6).npu()
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, (mine + 1).npu(), nxt), dist.P2POp(dist.irecv, got, prv)]):
        req.wait()
    check("batch_isend_irecv_ring", got, torch.arange(6, dtype=torch.float32) + 10 * prv + 1)

    # barrier: rank 0 comes 1 s late; the others must not leave before it came (one machine, one clock).
    if RANK == 0:
        time.sleep(1.0)
    results["barrier_entered_at"] = time.time()
    dist.barrier()
    results["barrier_left_at"] = time.time()

    # sub-groups [0, 1] and, with 4 ranks, [2, 3]: made by every rank, used by their members at once.
    groups = [dist.new_group([0, 1])] + ([dist.new_group([2, 3])] if WORLD == 4 else [])
    seed += 1
    xs = inputs(seed, (5,), torch.float32)
    if RANK // 2 < len(groups):
        members = [RANK // 2 * 2, RANK // 2 * 2 + 1]
        t = xs[RANK].npu()
        dist.all_reduce(t, group=groups[RANK // 2])
        check("new_group_all_reduce", t, fold("sum", [xs[m] for m in members]))
        out = torch.zeros(2 * 5).npu()
        dist.all_gather_into_tensor(out, xs[RANK].npu(), group=groups[RANK // 2])
        check("new_group_all_gather", out, torch.cat([xs[m] for m in members]))
    t = xs[RANK].npu()  # the world group still works after the sub-groups' calls
    dist.all_reduce(t)
    check("world_after_groups", t, fold("sum", xs))


def stop_and_restart(t: torch.Tensor) -> None:
    """A collective waits for a peer that never joins; torch_npu's stop_device aborts the device's tasks, later
    operators fail with FORCE STOP until restart_device, then the device and a new communicator work."""
    dist.all_reduce(t)  # queued: its HCCL call blocks the task queue's thread until the stop
    time.sleep(1)
    start = time.monotonic()
    torch_npu.npu.stop_device(torch.npu.current_device())
    results["stopped_after_s"] = time.monotonic() - start
    try:
        torch.npu.synchronize()
        results["after_stop"] = None
    except RuntimeError as error:
        results["after_stop"] = str(error).splitlines()[0]
    torch_npu.npu.restart_device(torch.npu.current_device())
    check("op_after_restart", torch.ones(4).npu() * 5, torch.full((4,), 5.0))
    alone = dist.new_group([RANK], backend="hccl")  # a new communicator after the restart
    t = torch.full((4,), 7.0).npu()
    dist.all_reduce(t, group=alone)
    check("new_communicator_after_restart", t, torch.full((4,), 7.0))


def stop_while_waiting(t: torch.Tensor) -> None:
    """With CANN_EMU_ASYNC_STREAMS=1: a collective waits for a peer that never joins while the host goes on, as
    on a device. The launch returns, work queued behind it waits, and a host synchronisation blocks without
    holding the GIL, so another Python thread (torchft's timer, here a plain one) runs and stops the device."""
    ticks = [0]
    beating = threading.Event()

    def heartbeat() -> None:
        while not beating.wait(0.05):
            ticks[0] += 1

    threading.Thread(target=heartbeat, daemon=True).start()
    # communicators with nothing in flight at the stop
    idle, unresumed = dist.new_group([RANK], backend="hccl"), dist.new_group([RANK], backend="hccl")
    one = torch.full((4,), 3.0).npu()
    dist.all_reduce(one, group=idle)
    dist.all_reduce(one, group=unresumed)
    torch.npu.synchronize()
    start = time.monotonic()
    dist.all_reduce(t)
    doubled = t * 2  # queued on the compute stream behind the collective's end
    torch.npu.current_stream().npu_stream  # torch_npu empties its task queue here, GIL held
    results["host_went_on_after_s"] = time.monotonic() - start
    stopped_at = []

    def stop_later() -> None:
        time.sleep(1)
        stopped_at.append(time.monotonic())
        torch_npu.npu.stop_device(torch.npu.current_device())

    timer = threading.Thread(target=stop_later)
    ticks_before = ticks[0]
    timer.start()
    try:
        torch.npu.synchronize()
        results["after_stop"] = None
    except RuntimeError as error:
        results["after_stop"] = str(error).splitlines()[0]
    timer.join()
    results["synchronize_ended_after_stop_s"] = time.monotonic() - stopped_at[0] if stopped_at else None
    results["heartbeats_while_waiting"] = ticks[0] - ticks_before
    beating.set()
    del doubled
    torch_npu.npu.restart_device(torch.npu.current_device())
    check("op_after_restart", torch.ones(4).npu() * 5, torch.full((4,), 5.0))
    # HCCL suspends every communicator at the stop: each refuses calls until it is resumed
    idle._get_backend(torch.device("npu")).resume_hccl_comm(torch.npu.current_device())
    one = torch.full((4,), 3.0).npu()
    dist.all_reduce(one, group=idle)
    check("idle_after_resume", one, torch.full((4,), 3.0))
    # the world group's all-reduce was cut by the stop: the emulation cannot resume that one, and says so
    try:
        dist.group.WORLD._get_backend(torch.device("npu")).resume_hccl_comm(torch.npu.current_device())
        results["cut_resume"] = None
    except RuntimeError as error:
        results["cut_resume"] = " ".join(str(error).split())[:400]
    alone = dist.new_group([RANK], backend="hccl")
    t = torch.full((4,), 7.0).npu()
    dist.all_reduce(t, group=alone)
    check("new_communicator_after_restart", t, torch.full((4,), 7.0))
    # last: the refusal runs in torch_npu's task queue, whose thread it ends (the process's device is then done)
    refused_at = time.monotonic()
    try:
        dist.all_reduce(one, group=unresumed)
        # The task queue reports the refusal when it reaches the call: a synchronisation issued before that
        # returned clean in some CI runs, and a loaded 2-core CI machine once kept it from coming back within
        # 5 s, so poll (at most 60 s) until the queue's error comes back, and say how long it took.
        for _ in range(600):
            torch.npu.synchronize()
            time.sleep(0.1)
        results["unresumed"] = None
    except RuntimeError as error:
        results["unresumed"] = " ".join(str(error).split())[:200]
    results["unresumed_surfaced_after_s"] = round(time.monotonic() - refused_at, 2)


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.npu.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("hccl")
    if mode == "collectives":
        collectives()
        torch.npu.synchronize()
        dist.destroy_process_group()
    else:
        t = torch.ones(4).npu()
        dist.all_reduce(t)
        check("first_all_reduce", t, torch.full((4,), float(WORLD)))
        if RANK == WORLD - 1:
            if mode in ("hang", "stop", "stop_while_waiting"):
                time.sleep(2 * float(os.environ["CANN_EMU_HCCL_TIMEOUT"]))
            os._exit(0)
        if mode in ("stop", "stop_while_waiting"):
            (stop_and_restart if mode == "stop" else stop_while_waiting)(t)
            with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
                json.dump(results, f)
            os._exit(0)
        start = time.monotonic()
        try:
            dist.all_reduce(t)
            t.cpu()
            results["error"] = None
        except RuntimeError as error:
            results["error"] = str(error)
        results["failed_after_s"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)
    if mode != "collectives":
        os._exit(0)  # the communicators are broken; leave without tearing them down


if __name__ == "__main__":
    main()
