"""Reference ``torch_npu.npu_all_gather_base_mm`` and ``npu_mm_reduce_scatter_base`` (MC2), over c10d.

Docs entries (``_op_plugin_docs.py``; CANN's ``aclnnAllGatherMatmul.md`` and
``aclnnMatmulReduceScatter.md`` in hicann/ops-transformer ``mc2/``):

* ``npu_all_gather_base_mm(self, x2, hcom, world_size, *, bias=None, ..., gather_index=0,
  gather_output=True, comm_turn=0, ...) -> (output, gather_out)``: ``self`` (m, k) is
  all-gathered over the communicator ``hcom`` into ``gather_out`` (m * world_size, k), rank
  order, and ``output = gather_out @ x2`` (m * world_size, n). ``gather_out`` is empty when
  ``gather_output`` is False. Documented for training.
* ``npu_mm_reduce_scatter_base(self, x2, hcom, world_size, *, reduce_op='sum', bias=None, ...,
  comm_turn=0, ...) -> output``: ``self @ x2`` (m, n) summed over the ranks and scattered by
  rows: rank r keeps rows [r * m / world_size, (r + 1) * m / world_size).

Constraints both documents state, checked here as the kernels check them: float16/bfloat16
only, ``self`` and ``x2`` 2-D with equal k in [256, 65535), world_size 2, 4 or 8 (Atlas A2's
HCCS full mesh; A3 also 16), ``gather_index``/``comm_turn`` 0, no non-zero bias (accepted: None),
``reduce_op`` 'sum', m divisible by world_size for the reduce-scatter. The quantized arguments
(``x1_scale``, ``x2_scale``, ``output_dtype``, ``comm_mode``) are not implemented.

``hcom`` is HCCL's communicator name (``get_hccl_comm_name`` of the group's backend); here it may
also be a c10d group name, which is what the CPU rehearsal passes. The products accumulate in
float32 and round once, as the cube unit does; the collective runs on the rounded products (the
fused kernel's reduce-scatter adds bf16 partial sums, as HCCL does).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MC2_DTYPES = (torch.float16, torch.bfloat16)
MC2_WORLD_SIZES = (2, 4, 8)
MC2_K_RANGE = (256, 65535)  # [low, high)


# hcom -> its process group, held weakly (the cache keeps no destroyed group alive). An entry holds while
# its group is still registered with c10d: destroying a group unregisters it, and a group created again
# under the same name or communicator is another object, found by a new scan.
_group_of_hcom: dict[str, weakref.ref] = {}


def group_for_hcom(hcom: str) -> dist.ProcessGroup:
    """The process group whose HCCL communicator is named ``hcom`` (or the c10d group named so); the
    groups are scanned once per hcom."""
    cached = _group_of_hcom.get(hcom)
    group = cached() if cached is not None else None
    if group is None or group not in c10d._world.pg_names:
        group = _scan_for_hcom(hcom)
        _group_of_hcom[hcom] = weakref.ref(group)
    return group


def _scan_for_hcom(hcom: str) -> dist.ProcessGroup:
    for group, name in c10d._world.pg_names.items():
        if name == hcom:
            return group
    rank = dist.get_rank()
    for group in c10d._world.pg_names:
        try:
            backend = group._get_backend(torch.device("npu"))
        except RuntimeError:  # a group without an npu backend (gloo only)
            continue
        namer = getattr(backend, "get_hccl_comm_name", None)
        if namer is not None and namer(rank) == hcom:
            return group
    raise ValueError(f"hcom {hcom!r} names no process group of this process (neither a c10d group name nor an "
                     "HCCL communicator name from get_hccl_comm_name)")


def _check(fn: str, x1: torch.Tensor, x2: torch.Tensor, world_size: int, group: dist.ProcessGroup,
           bias: torch.Tensor | None, comm_turn: int, unsupported: dict[str, object]) -> None:
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{fn}: {name} (the quantized path) is not implemented in the reference")
    if x1.dtype not in MC2_DTYPES or x2.dtype != x1.dtype:
        raise ValueError(f"{fn}: self and x2 must both be float16 or bfloat16, got {x1.dtype} and {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2 or x1.shape[1] != x2.shape[0]:
        raise ValueError(f"{fn}: self (m, k) and x2 (k, n) must be 2-D with equal k, got "
                         f"{tuple(x1.shape)} and {tuple(x2.shape)}")
    low, high = MC2_K_RANGE
    if not low <= x1.shape[1] < high:
        raise ValueError(f"{fn}: k must be in [{low}, {high}), got {x1.shape[1]}")
    if world_size not in MC2_WORLD_SIZES or world_size != group.size():
        raise ValueError(f"{fn}: world_size must be one of {MC2_WORLD_SIZES} and the size of hcom's group "
                         f"({group.size()}), got {world_size}")
    if bias is not None and bool(bias.ne(0).any()):
        raise ValueError(f"{fn}: bias must be None or zeros (CANN: non-zero bias is not supported)")
    if comm_turn != 0:
        raise ValueError(f"{fn}: comm_turn must be 0, got {comm_turn}")


def _product(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return (x1.float() @ x2.float()).to(x1.dtype)


def npu_all_gather_base_mm(self: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, *,
                           bias: torch.Tensor | None = None, x1_scale: torch.Tensor | None = None,
                           x2_scale: torch.Tensor | None = None, gather_index: int = 0,
                           gather_output: bool = True, comm_turn: int = 0,
                           output_dtype: torch.dtype | None = None, comm_mode: str | None = None):
    """(all_gather(self) @ x2, all_gather(self) or an empty tensor)."""
    group = group_for_hcom(hcom)
    _check("npu_all_gather_base_mm", self, x2, world_size, group, bias, comm_turn,
           {"x1_scale": x1_scale, "x2_scale": x2_scale, "output_dtype": output_dtype, "comm_mode": comm_mode})
    if gather_index != 0:
        raise ValueError(f"npu_all_gather_base_mm: gather_index must be 0 (gather self), got {gather_index}")
    gathered = torch.empty((world_size * self.shape[0], self.shape[1]), dtype=self.dtype, device=self.device)
    dist.all_gather_into_tensor(gathered, self.contiguous(), group=group)
    output = _product(gathered, x2)
    return output, gathered if gather_output else self.new_empty((0,))


def npu_mm_reduce_scatter_base(self: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, *,
                               reduce_op: str = "sum", bias: torch.Tensor | None = None,
                               x1_scale: torch.Tensor | None = None, x2_scale: torch.Tensor | None = None,
                               comm_turn: int = 0, output_dtype: torch.dtype | None = None,
                               comm_mode: str | None = None):
    """reduce_scatter(self @ x2) by rows, summed."""
    group = group_for_hcom(hcom)
    _check("npu_mm_reduce_scatter_base", self, x2, world_size, group, bias, comm_turn,
           {"x1_scale": x1_scale, "x2_scale": x2_scale, "output_dtype": output_dtype, "comm_mode": comm_mode})
    if reduce_op != "sum":
        raise ValueError(f"npu_mm_reduce_scatter_base: reduce_op must be 'sum', got {reduce_op!r}")
    if self.shape[0] % world_size:
        raise ValueError(f"npu_mm_reduce_scatter_base: m ({self.shape[0]}) must be divisible by world_size "
                         f"({world_size})")
    product = _product(self, x2).contiguous()
    output = product.new_empty((self.shape[0] // world_size, x2.shape[1]))
    dist.reduce_scatter_tensor(output, product, group=group)
    return output
