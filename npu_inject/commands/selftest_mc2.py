"""The selftest's collective cases: the MC2 kernels (collective + GEMM in one operator) on N devices.

``npu_all_gather_base_mm`` and ``npu_mm_reduce_scatter_base`` need a process group, so these cases
run in ``--ranks`` processes, one per device, over torch_npu's ``hccl`` backend, called with the
arguments ``npu_inject/ops/tp_mc2.py`` passes. Each is checked against independent PyTorch math on
the host: every rank makes every rank's inputs from the same seeds, so the reference is a plain
matmul of the concatenated (all-gather) or summed (reduce-scatter) operands, with autograd, and
needs no collective at all.

torch_npu 2.14.0 registers no autograd for the MC2 ops; a tensor-parallel linear's backward is the
other MC2 op (torchtitan's dist_gemm Functions and inductor's async-TP pass both do this), so each
case is a linear layer the way TP runs it, forward and backward:

* column-parallel (all-gather the rows, then matmul): forward ``npu_all_gather_base_mm(x, w)``;
  backward dx = ``npu_mm_reduce_scatter_base(dy, w.T)``, dw = gathered_x.T @ dy;
* row-parallel (matmul, then reduce-scatter the rows): forward ``npu_mm_reduce_scatter_base(x, w)``;
  backward ``npu_all_gather_base_mm(dy, w.T)`` gives dx and the gathered dy, dw = x.T @ gathered_dy.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

from npu_inject.commands.selftest_compare import SEED, Row, compare_into

# MC2's documented constraints (fp16/bf16, k in [256, 65535), rows divisible by the ranks) hold.
ROWS_PER_RANK, K, N = 64, 256, 256
MC2_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class CollectiveCase:
    name: str
    run: Callable[..., list[tuple[str, Any, Any]]]  # (rank, world, dtype, device, torch_npu, hcom, seed) -> pairs
    used_by: str = "ops/tp_mc2.py"


def _inputs(seed: int, world: int, dtype, *shapes: tuple[int, ...]) -> list[list[Any]]:
    """For each shape, one tensor per rank, the same on every rank (seeded per rank and shape)."""
    import torch

    out = []
    for index, shape in enumerate(shapes):
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        out.append([(torch.randn(*shape, generator=generator) / shape[-1] ** 0.25).to(dtype) for _ in range(world)])
    return out


def _column_parallel(rank, world, dtype, device, torch_npu, hcom, seed):
    import torch

    xs, ws, dys = _inputs(seed, world, dtype, (ROWS_PER_RANK, K), (K, N), (ROWS_PER_RANK * world, N))
    # Reference: X = cat(x_r); y_r = X @ w_r; loss = sum_r <y_r, dy_r>.
    leaves_x = [x.float().requires_grad_() for x in xs]
    leaves_w = [w.float().requires_grad_() for w in ws]
    gathered_ref = torch.cat(leaves_x)
    ys_ref = [gathered_ref @ w for w in leaves_w]
    sum((y * dy.float()).sum() for y, dy in zip(ys_ref, dys)).backward()
    x, w, dy = xs[rank].to(device), ws[rank].to(device), dys[rank].to(device)
    y, gathered = torch_npu.npu_all_gather_base_mm(x, w, hcom, world, gather_output=True)
    dx = torch_npu.npu_mm_reduce_scatter_base(dy, w.t().contiguous(), hcom, world, reduce_op="sum")
    dw = gathered.t() @ dy
    return [("y", y, ys_ref[rank]), ("gathered x", gathered, gathered_ref),
            ("dx", dx, leaves_x[rank].grad), ("dw", dw, leaves_w[rank].grad)]


def _row_parallel(rank, world, dtype, device, torch_npu, hcom, seed):
    import torch

    rows = ROWS_PER_RANK * world
    xs, ws, dys = _inputs(seed, world, dtype, (rows, K), (K, N), (ROWS_PER_RANK, N))
    # Reference: Y = sum_r x_r @ w_r; rank r keeps rows chunk r; loss = sum_r <Y[chunk r], dy_r>.
    leaves_x = [x.float().requires_grad_() for x in xs]
    leaves_w = [w.float().requires_grad_() for w in ws]
    total = sum(x @ w for x, w in zip(leaves_x, leaves_w))
    chunks = total.chunk(world)
    sum((chunk * dy.float()).sum() for chunk, dy in zip(chunks, dys)).backward()
    x, w, dy = xs[rank].to(device), ws[rank].to(device), dys[rank].to(device)
    y = torch_npu.npu_mm_reduce_scatter_base(x, w, hcom, world, reduce_op="sum")
    dx, gathered_dy = torch_npu.npu_all_gather_base_mm(dy, w.t().contiguous(), hcom, world, gather_output=True)
    dw = x.t() @ gathered_dy
    return [("y", y, chunks[rank]), ("gathered dy", gathered_dy, torch.cat(dys).float()),
            ("dx", dx, leaves_x[rank].grad), ("dw", dw, leaves_w[rank].grad)]


CASES = [
    CollectiveCase("all_gather_base_mm + mm_reduce_scatter_base: column-parallel linear (MC2)", _column_parallel),
    CollectiveCase("mm_reduce_scatter_base + all_gather_base_mm: row-parallel linear (MC2)", _row_parallel),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, dtypes: list[str], tolerance_scale: float, names: list[str],
            queue) -> None:
    import torch
    import torch.distributed as dist
    import torch_npu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.npu.set_device(rank)
    device = torch.device("npu", rank)
    dist.init_process_group("hccl", rank=rank, world_size=world, device_id=device)
    try:
        hcom = dist.group.WORLD._get_backend(device).get_hccl_comm_name(rank)
        rows = []
        for number, case in enumerate(CASES):
            for dtype_name in dtypes if case.name in names else ():
                row = Row(case.name, dtype_name, "PASS")
                try:
                    pairs = case.run(rank, world, getattr(torch, dtype_name), device, torch_npu, hcom, SEED + number)
                except Exception as exc:  # a kernel that rejects the call is this row's finding
                    row.status = "ERROR"
                    row.detail = f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0][:160]
                    rows.append(row)
                    continue
                rows.append(compare_into(row, pairs, tolerance_scale, where=f"rank {rank}: "))
        queue.put((rank, rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_all(world: int, dtypes: list[str], tolerance_scale: float, cases: list[CollectiveCase] | None = None) -> list:
    """One row per (case, dtype), the worst over the ranks; ERROR rows when the ranks cannot start."""
    import torch
    import torch.multiprocessing as mp

    dtypes = [name for name in dtypes if name in MC2_DTYPES]
    cases = CASES if cases is None else cases
    if not dtypes or not cases:
        return []
    available = torch.npu.device_count()
    if available < world:
        return [Row(case.name, dtype, "ERROR",
                    detail=f"needs {world} devices (--ranks), this machine shows {available}; --ranks 0 "
                           "leaves the collective cases out")
                for case in cases for dtype in dtypes]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, dtypes, tolerance_scale,
                                                       [case.name for case in cases], queue))
                 for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(600)
    results = {}
    while not queue.empty():
        rank, rows = queue.get()
        results[rank] = rows
    failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0 or rank not in results]
    if failed:
        return [Row(case.name, dtype, "ERROR",
                    detail=f"rank(s) {failed} exited {[processes[r].exitcode for r in failed]} without results")
                for case in cases for dtype in dtypes]
    merged = []
    for position, row in enumerate(results[0]):
        per_rank = [results[rank][position] for rank in range(world)]
        worst = next((r for r in per_rank if r.status != "PASS"), max(per_rank, key=lambda r: r.worst))
        worst.worst = max(r.worst for r in per_rank)
        worst.max_abs = max(r.max_abs for r in per_rank)
        merged.append(worst)
    return merged
