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
:func:`mc2_refusal`, the one list: the K axis gathered or scattered, float32, k outside [256, 65535),
2/4/8 ranks, ...) runs the plain collective and a matmul instead; ``on_fallback`` hears each reason
(the patch logs it once and lists it in the report). Either way the result is the op's, so torch.compile, which sees one
opaque op per call, and autograd (torchtitan's own Functions) are unaffected.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from npu_inject.ops import kernels
from npu_inject.ops.reference.mc2 import MC2_DTYPES, MC2_K_RANGE, MC2_WORLD_SIZES

# Told why a call ran the plain collective (the patch records it once in the report).
on_fallback: Callable[[str], None] = lambda reason: None  # noqa: E731 - replaced by the patch


# Each group's hcom, asked once per group. Keyed by the group object, weakly: a destroyed group's entry
# goes with it, and a group created again under the same c10d name is another object, asked anew.
_hcom_of_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hcom_name(group: dist.ProcessGroup) -> str:
    """The MC2 kernels' ``hcom``: HCCL's communicator name of the group on an NPU (asked with the global
    rank, as torch_npu's docs say), the c10d group name on the CPU rehearsal."""
    name = _hcom_of_group.get(group)
    if name is None:
        try:
            backend = group._get_backend(torch.device("npu"))
        except RuntimeError:  # no npu backend: the rehearsal's gloo group
            name = group.group_name
        else:
            name = backend.get_hccl_comm_name(dist.get_rank())
        _hcom_of_group[group] = name
    return name


def mc2_refusal(A: torch.Tensor, B: torch.Tensor, world_size: int, *, axis: int, scatter: bool,
                reduce_op: str = "sum") -> str | None:
    """Why the MC2 kernel cannot run one call (None: it can): ``A`` all-gathered along ``axis`` and
    multiplied by ``B`` (``scatter`` False), or ``A @ B`` reduce-scattered along ``axis`` (True), over
    ``world_size`` ranks. Every constraint once, in one list."""
    axis %= A.dim()
    if A.dim() < 2 or axis == A.dim() - 1:
        return "scatters the K axis (MC2 scatters rows)" if scatter else "gathers the K axis (MC2 gathers rows)"
    if scatter and reduce_op != "sum":
        return f"reduce_op {reduce_op!r} (MC2 sums)"
    if A.dtype not in MC2_DTYPES or B.dtype != A.dtype:
        return f"dtype {A.dtype}/{B.dtype} (MC2 takes float16 or bfloat16)"
    if world_size not in MC2_WORLD_SIZES:
        return f"{world_size} ranks (MC2 takes {', '.join(map(str, MC2_WORLD_SIZES))})"
    low, high = MC2_K_RANGE
    if not low <= A.shape[-1] < high:
        return f"k={A.shape[-1]} (MC2 takes k in [{low}, {high}))"
    if scatter and A.shape[axis] % world_size:
        return f"m={A.shape[axis]} (the scatter axis) not divisible by {world_size} ranks"
    return None


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` moved to the front, flattened to (rows, last); a copy only when not already so."""
    return x.movedim(dim, 0).reshape(-1, x.shape[-1])


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group_name: str,
                            *, return_A: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    group = c10d._resolve_process_group(group_name)
    world_size = group.size()
    gather_dim %= A_shard.dim()
    refusal = mc2_refusal(A_shard, Bs[0], world_size, axis=gather_dim, scatter=False)
    if refusal is not None:
        on_fallback(f"fused_all_gather_matmul: {refusal}: all-gather + matmul")
        A, outputs = _all_gather_then_matmul(A_shard, Bs, gather_dim, group)
        return (A if return_A else None), outputs
    front_shape = A_shard.movedim(gather_dim, 0).shape  # (m_local, ..., k)
    first, gathered_MK = kernels().npu_all_gather_base_mm(_rows(A_shard, gather_dim), Bs[0], hcom_name(group),
                                                          world_size, gather_output=True)
    outputs = [first, *(gathered_MK @ b for b in Bs[1:])]

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
    refusal = mc2_refusal(A, B, world_size, axis=scatter_dim, scatter=True, reduce_op=reduce_op)
    if refusal is None:
        front_shape = A.movedim(scatter_dim, 0).shape  # (m, ..., k)
        out_MN = kernels().npu_mm_reduce_scatter_base(_rows(A, scatter_dim), B, hcom_name(group), world_size,
                                                      reduce_op="sum")
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
