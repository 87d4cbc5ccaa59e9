"""torch's symmetric-memory fused TP ops on Ascend's MC2 kernels: one collective+GEMM operator each.

torchtitan's ``dist_gemm`` (``torchtitan/distributed/linear.py``, forward and backward) and inductor's
micro-pipeline TP pass (``--compile.enable_async_tensor_parallel``) both end in two ops that torch
defines with CUDA kernels only:

* ``symm_mem::fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True)
  -> (A or None, [A @ B for B in Bs])``, A the all-gather of A_shard along gather_dim;
* ``symm_mem::fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)
  -> reduce_scatter(A @ B) along scatter_dim``.

These are their kernels for the run's device. Each call moves the gather (scatter) axis to the
front and flattens to rows, which is what the MC2 kernels gather and scatter, then runs
``npu_all_gather_base_mm`` (the first B; further Bs are plain matmuls on the gathered rows, one
collective in all) or ``npu_mm_reduce_scatter_base``. A call outside what MC2 accepts (see
:func:`mc2_refusal`: float32, k outside [256, 65535), 2/4/8 ranks, the K axis gathered, ...) runs the
plain collective and a matmul instead; ``on_fallback`` hears each reason (the patch logs it once
and lists it in the report). Either way the result is the op's, so torch.compile, which sees one
opaque op per call, and autograd (torchtitan's own Functions) are unaffected.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from npu_inject.ops import kernels
from npu_inject.ops.reference.mc2 import MC2_DTYPES, MC2_K_RANGE, MC2_WORLD_SIZES

# Told why a call ran the plain collective (the patch records it once in the report).
on_fallback: Callable[[str], None] = lambda reason: None  # noqa: E731 - replaced by the patch


@functools.lru_cache(maxsize=None)
def hcom_name(group_name: str) -> str:
    """The MC2 kernels' ``hcom``: HCCL's communicator name of the group on an NPU (asked with the global
    rank, as torch_npu's docs say), the c10d group name on the CPU rehearsal."""
    group = c10d._resolve_process_group(group_name)
    try:
        backend = group._get_backend(torch.device("npu"))
    except RuntimeError:  # no npu backend: the rehearsal's gloo group
        return group_name
    return backend.get_hccl_comm_name(dist.get_rank())


def mc2_refusal(a_MK: torch.Tensor, b_KN: torch.Tensor, world_size: int, *, scatter: bool) -> str | None:
    """Why the MC2 kernel cannot take ``a_MK @ b_KN`` over ``world_size`` ranks (None: it can)."""
    if a_MK.dtype not in MC2_DTYPES or b_KN.dtype != a_MK.dtype:
        return f"dtype {a_MK.dtype}/{b_KN.dtype} (MC2 takes float16 or bfloat16)"
    if world_size not in MC2_WORLD_SIZES:
        return f"{world_size} ranks (MC2 takes {', '.join(map(str, MC2_WORLD_SIZES))})"
    low, high = MC2_K_RANGE
    if not low <= a_MK.shape[1] < high:
        return f"k={a_MK.shape[1]} (MC2 takes k in [{low}, {high}))"
    if scatter and a_MK.shape[0] % world_size:
        return f"m={a_MK.shape[0]} not divisible by {world_size} ranks"
    return None


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` moved to the front, flattened to (rows, last); a copy only when not already so."""
    return x.movedim(dim, 0).reshape(-1, x.shape[-1])


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group_name: str,
                            *, return_A: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    group = c10d._resolve_process_group(group_name)
    world_size = group.size()
    gather_dim %= A_shard.dim()
    if gather_dim == A_shard.dim() - 1 or A_shard.dim() < 2:
        on_fallback("fused_all_gather_matmul gathers the K axis (MC2 gathers rows): all-gather + matmul")
        return _all_gather_then_matmul(A_shard, Bs, gather_dim, group)
    front_shape = A_shard.movedim(gather_dim, 0).shape  # (m_local, ..., k)
    a_MK = _rows(A_shard, gather_dim)
    refusal = mc2_refusal(a_MK, Bs[0], world_size, scatter=False)
    if refusal is None:
        first, gathered_MK = kernels().npu_all_gather_base_mm(a_MK, Bs[0], hcom_name(group_name), world_size,
                                                              gather_output=True)
        outputs = [first, *(gathered_MK @ b for b in Bs[1:])]
    else:
        on_fallback(f"fused_all_gather_matmul: {refusal}: all-gather + matmul")
        gathered_MK = a_MK.new_empty((world_size * a_MK.shape[0], a_MK.shape[1]))
        dist.all_gather_into_tensor(gathered_MK, a_MK.contiguous(), group=group)
        outputs = [gathered_MK @ b for b in Bs]

    def unflatten(rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(world_size * front_shape[0], *front_shape[1:-1], rows.shape[-1]).movedim(0, gather_dim)

    return (unflatten(gathered_MK) if return_A else None), [unflatten(out) for out in outputs]


def _all_gather_then_matmul(A_shard, Bs, gather_dim, group):
    """The op's plain definition (torch's Meta kernel does the same on fake tensors)."""
    world_size = group.size()
    shard = A_shard.movedim(gather_dim, 0).contiguous()
    gathered = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(gathered, shard, group=group)
    A = gathered.movedim(0, gather_dim)
    return A, [A @ b for b in Bs]


def fused_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                                group_name: str) -> torch.Tensor:
    group = c10d._resolve_process_group(group_name)
    world_size = group.size()
    scatter_dim %= A.dim()
    front_shape = A.movedim(scatter_dim, 0).shape  # (m, ..., k)
    refusal = None
    if scatter_dim == A.dim() - 1 or A.dim() < 2:
        refusal = "scatters the K axis (MC2 scatters rows)"
    elif reduce_op != "sum":
        refusal = f"reduce_op {reduce_op!r} (MC2 sums)"
    elif front_shape[0] % world_size:
        refusal = f"scatter axis of {front_shape[0]} not divisible by {world_size} ranks"
    a_MK = _rows(A, scatter_dim) if refusal is None else None
    if refusal is None:
        refusal = mc2_refusal(a_MK, B, world_size, scatter=True)
    if refusal is None:
        out_MN = kernels().npu_mm_reduce_scatter_base(a_MK, B, hcom_name(group_name), world_size, reduce_op="sum")
        return out_MN.reshape(front_shape[0] // world_size, *front_shape[1:-1], B.shape[-1]).movedim(0, scatter_dim)
    on_fallback(f"fused_matmul_reduce_scatter: {refusal}: matmul + reduce-scatter")
    product = (A @ B).movedim(scatter_dim, 0).contiguous()
    output = product.new_empty((product.shape[0] // world_size, *product.shape[1:]))
    dist.reduce_scatter_tensor(output, product, op=_REDUCE_OPS[reduce_op], group=group)
    return output.movedim(0, scatter_dim)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}

# op name -> kernel, for torch.library registration under the run's dispatch key
KERNELS = {
    "fused_all_gather_matmul": fused_all_gather_matmul,
    "fused_matmul_reduce_scatter": fused_matmul_reduce_scatter,
}
