"""Context parallel attention on ``npu_fusion_attention``.

torchtitan shards every sequence over the CP ranks (optionally reordered by a
load balancer: head-tail or PTRR), so each rank holds ``l = L / cp`` query rows
whose global positions are not contiguous. Two schemes compute exact attention
for every mask the attention patch expresses (causal, packed-document causal,
sliding window, full) and for varlen:

* ``ulysses``: an all-to-all turns (B, l, N, H) sequence shards into (B, L, N/cp, H)
  head shards, rows go back to natural order, one whole-sequence kernel call runs
  the unchanged plan, and the reverse path returns (B, l, N, H). Key/value heads
  fewer than (or not divisible by) cp are repeated up to lcm(N_kv, cp) first.
* ``allgather``: key/value are all-gathered and put in natural order; the local
  queries are cut into segments (one per contiguous run of positions per
  document per row), each attending to its document's keys up to its last query
  -- one TND kernel call for all segments, right-down causal (mode 3) or
  right-down band (mode 4) or full (mode 0).

Collectives are autograd functions built on plain ``torch.distributed`` calls
(all_to_all_single, all_gather_into_tensor, all_reduce), which gloo, HCCL and the
simulated hccl all provide.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import spmd_types as spmd
import torch
import torch.distributed as dist

from npu_inject.ops import kernels, spmd_typing
from npu_inject.ops.attention import (
    SPARSE_BAND,
    SPARSE_RIGHT_DOWN_CAUSAL,
    AttentionPlan,
    compressed_causal_mask,
    fusion_attention_BLNH,
    plan_keep_mask,
    reference_attention_BLNH,
)

@dataclass(frozen=True)
class ContextParallelPlan:
    """What torchtitan's attention masks become under CP: the global masks plus where the local rows sit.

    ``plan`` is the flex mask's AttentionPlan over the whole (B, L) batch (None for
    varlen, whose module supplies causal/window); ``varlen_offsets`` are varlen's
    cumulative document offsets over B*L (None for flex). ``local_positions`` are
    the global positions of this rank's l rows (the same for every batch row);
    ``balanced_order`` the global positions of all ranks' rows, rank after rank.
    ``cu_seq_q_host`` mirrors VarlenMetadata so the varlen patch reads offsets alike.
    """

    plan: AttentionPlan | None
    varlen_offsets: tuple[int, ...] | None
    local_positions: tuple[int, ...]
    balanced_order: tuple[int, ...]
    scheme: str  # as requested: "auto", "ulysses" or "allgather"
    group: dist.ProcessGroup
    report: Callable[[str], None] | None = field(default=None, compare=False)

    @property
    def cu_seq_q_host(self) -> tuple[int, ...] | None:
        return self.varlen_offsets

    @property
    def world_size(self) -> int:
        return len(self.balanced_order) // len(self.local_positions)


def choose_scheme(requested: str, n_heads: int, cp_degree: int) -> str:
    """The scheme that runs: ``requested``, or for "auto" Ulysses when heads divide, else all-gather."""
    if requested == "auto":
        return "ulysses" if n_heads % cp_degree == 0 else "allgather"
    return requested


# -- collectives with autograd --------------------------------------------------


def _all_to_all(x_W: torch.Tensor, group) -> torch.Tensor:
    x_W = x_W.contiguous()  # the collective reads and writes flat memory
    out_W = torch.empty_like(x_W, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out_W, x_W, group=group)
    return out_W


@spmd.register_autograd_function
class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own adjoint."""

    @staticmethod
    def typecheck_forward(x_W, group):
        """SPMD type: V on the group in and out (each rank sends and receives its own chunks);
        the other axes pass through."""
        spmd.assert_type(x_W, {group: spmd.V})
        out_W = _AllToAll.apply(x_W, group)
        spmd.assert_type(out_W, {**spmd.get_local_type(x_W), group: spmd.V})
        return out_W

    @staticmethod
    def forward(ctx, x_W, group):
        ctx.group = group
        return _all_to_all(x_W, group)

    @staticmethod
    def backward(ctx, grad_W):
        return _all_to_all(grad_W, ctx.group), None


@spmd.register_autograd_function
class _AllGather(torch.autograd.Function):
    """All-gather along dim 0; backward sums every rank's gradient and keeps this rank's slice."""

    @staticmethod
    def typecheck_forward(x, group):
        """SPMD type: V on the group in, R out (every rank holds all shards), as spmd_types'
        all_gather; the other axes pass through."""
        spmd.assert_type(x, {group: spmd.V})
        out = _AllGather.apply(x, group)
        spmd.assert_type(out, {**spmd.get_local_type(x), group: spmd.R})
        return out

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


@functools.lru_cache(maxsize=16)
def _natural_order_index(balanced_order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Index that puts rows gathered rank after rank back in position order."""
    inverse = [0] * len(balanced_order)
    for gathered_row, position in enumerate(balanced_order):
        inverse[position] = gathered_row
    return torch.tensor(inverse, dtype=torch.long, device=device)


@functools.lru_cache(maxsize=16)
def _balanced_order_index(balanced_order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(balanced_order, dtype=torch.long, device=device)


# -- Ulysses ---------------------------------------------------------------------


def _sequence_to_heads(x_BlNH: torch.Tensor, cp: ContextParallelPlan) -> torch.Tensor:
    """(B, l, N, H) sequence shard -> (B, L, N/cp, H) head shard in natural position order."""
    B, l, N, H = x_BlNH.shape
    W = cp.world_size
    x_WBlnH = x_BlNH.reshape(B, l, W, N // W, H).permute(2, 0, 1, 3, 4)
    gathered_WBlnH = _AllToAll.apply(x_WBlnH.contiguous(), cp.group)
    x_BLnH = gathered_WBlnH.permute(1, 0, 2, 3, 4).reshape(B, W * l, N // W, H)
    natural = spmd_typing.replicated_metadata(_natural_order_index(cp.balanced_order, x_BLnH.device))
    return x_BLnH.index_select(1, natural)


def _gathered_heads(x_BLNH: torch.Tensor, cp: ContextParallelPlan) -> torch.Tensor:
    """Whole-sequence (B, L, N, H) rows, rank after rank -> (B, L, N/cp, H): this rank's heads in natural
    order, what :func:`_sequence_to_heads` gives from a shard (no exchange needed)."""
    B, L, N, H = x_BLNH.shape
    n, rank = N // cp.world_size, dist.get_rank(cp.group)
    natural = spmd_typing.replicated_metadata(_natural_order_index(cp.balanced_order, x_BLNH.device))
    x_BLnH = x_BLNH.index_select(1, natural)[:, :, rank * n:(rank + 1) * n]
    if spmd_typing.type_checking():
        # Replicated rows, this rank's heads: varying over the CP ranks (the gradient is partial,
        # as upstream's boundary declares for gathered key/value).
        spmd.mutate_type(x_BLnH, cp.group, src=spmd.R, dst=spmd.V)
    return x_BLnH


def kv_gathered(q_BlNH: torch.Tensor, k_BLNH: torch.Tensor, cp: ContextParallelPlan) -> bool:
    """Whether key/value arrive whole-sequence: with the spmd_types backend upstream's inner-attention
    boundary all-gathers them over CP (``set_gqa_inner_attention_local_map``: k/v R on cp), rank after
    rank; otherwise they are this rank's l rows like the query."""
    l, rows = q_BlNH.shape[1], k_BLNH.shape[1]
    if rows == l * cp.world_size:
        return True
    if rows == l:
        return False
    raise ValueError(f"context parallel: key/value have {rows} rows per sequence; with {l} query rows on "
                     f"each of cp={cp.world_size} ranks they must be {l} (sharded) or {l * cp.world_size} (gathered)")


def _heads_to_sequence(x_BLnH: torch.Tensor, cp: ContextParallelPlan) -> torch.Tensor:
    """(B, L, N/cp, H) in natural order -> (B, l, N, H) of this rank's rows."""
    B, L, n, H = x_BLnH.shape
    W = cp.world_size
    l = L // W
    balanced = spmd_typing.replicated_metadata(_balanced_order_index(cp.balanced_order, x_BLnH.device))
    balanced_BLnH = x_BLnH.index_select(1, balanced)
    x_WBlnH = balanced_BLnH.reshape(B, W, l, n, H).permute(1, 0, 2, 3, 4)
    returned_WBlnH = _AllToAll.apply(x_WBlnH.contiguous(), cp.group)
    return returned_WBlnH.permute(1, 2, 0, 3, 4).reshape(B, l, W * n, H)


def _ulysses(q_BlNH, k_BlNH, v_BlNH, cp: ContextParallelPlan, plan: AttentionPlan, scale):
    W, N, N_kv = cp.world_size, q_BlNH.shape[2], k_BlNH.shape[2]
    if N % W:
        raise ValueError(f"context parallel scheme 'ulysses' needs the {N} query heads divisible by cp={W}")
    if N_kv % W:
        # GQA with fewer (or indivisible) kv heads: repeat each so every rank holds the kv heads
        # its query heads use; lcm(N_kv, W) divides N because both N_kv and W do.
        repeat = math.lcm(N_kv, W) // N_kv
        k_BlNH, v_BlNH = (t.repeat_interleave(repeat, dim=2) for t in (k_BlNH, v_BlNH))
    q_BLnH = _sequence_to_heads(q_BlNH, cp)
    to_heads = _gathered_heads if kv_gathered(q_BlNH, k_BlNH, cp) else _sequence_to_heads
    k_BLnH, v_BLnH = (to_heads(t, cp) for t in (k_BlNH, v_BlNH))
    out_BLnH, _ = fusion_attention_BLNH(q_BLnH, k_BLnH, v_BLnH, plan, scale)
    return _heads_to_sequence(out_BLnH, cp)


# -- all-gather key/value -----------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _segments(plan: AttentionPlan, local_positions: tuple[int, ...], B: int, L: int):
    """(query rows, key rows, query lengths, key lengths) of the TND call, as host lists.

    Query rows index the local (B*l) rows, key rows the natural-order (B*L) rows.
    Every local row falls in exactly one segment: documents partition each row.
    """
    l = len(local_positions)
    ends = plan.document_ends or tuple(L * (b + 1) for b in range(B))
    starts = (0,) + tuple(ends[:-1])
    # Contiguous runs of global positions among the local rows: (first local row, first position, length).
    runs, first = [], 0
    for row in range(1, l + 1):
        if row == l or local_positions[row] != local_positions[row - 1] + 1:
            runs.append((first, local_positions[first], row - first))
            first = row
    q_rows, k_rows, q_lens, k_lens = [], [], [], []
    for b in range(B):
        documents = [(max(s, b * L), min(e, (b + 1) * L)) for s, e in zip(starts, ends)
                     if s < (b + 1) * L and e > b * L]
        for local_first, position, length in runs:
            run_start, run_end = b * L + position, b * L + position + length
            for doc_start, doc_end in documents:
                q_start, q_end = max(run_start, doc_start), min(run_end, doc_end)
                if q_start >= q_end:
                    continue
                if not plan.causal:
                    k_start, k_end = doc_start, doc_end
                elif plan.window is None:
                    k_start, k_end = doc_start, q_end
                else:
                    k_start, k_end = max(doc_start, q_start - plan.window + 1), q_end
                local_start = b * l + local_first + (q_start - run_start)
                q_rows.extend(range(local_start, local_start + q_end - q_start))
                k_rows.extend(range(k_start, k_end))
                q_lens.append(q_end - q_start)
                k_lens.append(k_end - k_start)
    return q_rows, k_rows, q_lens, k_lens


@functools.lru_cache(maxsize=16)
def _segment_indices(plan, local_positions, B, L, device):
    q_rows, k_rows, q_lens, k_lens = _segments(plan, local_positions, B, L)
    q_index = torch.tensor(q_rows, dtype=torch.long, device=device)
    return (q_index, torch.argsort(q_index), torch.tensor(k_rows, dtype=torch.long, device=device),
            list(itertools.accumulate(q_lens)), list(itertools.accumulate(k_lens)))


def _whole_sequence_BLNH(x_BlNH: torch.Tensor, cp: ContextParallelPlan, natural: torch.Tensor,
                        gathered: bool) -> torch.Tensor:
    """Key or value over the whole sequence, (B, L, N, H) in natural order: all-gathered over CP,
    or reordered when the spmd_types boundary already gathered them (rank after rank)."""
    if gathered:
        return x_BlNH.index_select(1, natural)
    gathered_WBlNH = _AllGather.apply(x_BlNH.transpose(0, 1).contiguous(), cp.group)  # (W*l, B, N, H)
    return gathered_WBlNH.index_select(0, natural).transpose(0, 1)


def _allgather_kv(q_BlNH, k_BlNH, v_BlNH, cp: ContextParallelPlan, plan: AttentionPlan, scale):
    B, l, N, H = q_BlNH.shape
    L = l * cp.world_size
    natural = spmd_typing.replicated_metadata(_natural_order_index(cp.balanced_order, q_BlNH.device))

    gathered = kv_gathered(q_BlNH, k_BlNH, cp)
    k_TNH, v_TNH = (_whole_sequence_BLNH(x_BlNH, cp, natural, gathered).reshape(B * L, *x_BlNH.shape[2:])
                    for x_BlNH in (k_BlNH, v_BlNH))
    q_index, q_restore, k_index, q_ends, k_ends = _segment_indices(plan, cp.local_positions, B, L, q_BlNH.device)
    # Built from host lists every rank shares (cached, possibly outside a type-checked forward).
    q_index, q_restore, k_index = (spmd_typing.replicated_metadata(t) for t in (q_index, q_restore, k_index))
    q_SNH = q_BlNH.reshape(B * l, N, H).index_select(0, q_index)
    k_SNH, v_SNH = k_TNH.index_select(0, k_index), v_TNH.index_select(0, k_index)
    arguments = {"scale": 1.0 / math.sqrt(H) if scale is None else scale}
    if not plan.causal:
        arguments.update(sparse_mode=0, atten_mask=None)
    elif plan.window is None:
        arguments.update(sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL, atten_mask=compressed_causal_mask(q_BlNH.device))
    else:
        arguments.update(sparse_mode=SPARSE_BAND, pre_tockens=plan.window - 1, next_tockens=0,
                         atten_mask=compressed_causal_mask(q_BlNH.device))
    with spmd_typing.opaque_kernel():  # a typing boundary, as fusion_attention_BLNH
        out_SNH, *_ = kernels().npu_fusion_attention(
            q_SNH, k_SNH, v_SNH, N, "TND", actual_seq_qlen=q_ends, actual_seq_kvlen=k_ends, **arguments
        )
    out_SNH = spmd_typing.type_like(out_SNH, q_SNH)
    return out_SNH.index_select(0, q_restore).view(B, l, N, v_BlNH.shape[-1])


def context_parallel_attention_BLNH(q_BlNH, k_BlNH, v_BlNH, cp: ContextParallelPlan, plan: AttentionPlan,
                                    scale):
    """This rank's attention output (B, l, N, H) for its query rows under ``cp``'s scheme."""
    scheme = choose_scheme(cp.scheme, q_BlNH.shape[2], cp.world_size)
    if cp.report is not None:
        cp.report(f"context parallel scheme {scheme!r} ran (requested {cp.scheme!r}, "
                  f"{q_BlNH.shape[2]} query heads, cp={cp.world_size})")
    if scheme == "ulysses":
        return _ulysses(q_BlNH, k_BlNH, v_BlNH, cp, plan, scale)
    return _allgather_kv(q_BlNH, k_BlNH, v_BlNH, cp, plan, scale)


# -- reference path for an out_transform -------------------------------------------


def context_parallel_reference_attention_BLNH(q_BlNH, k_BlNH, v_BlNH, cp: ContextParallelPlan,
                                              plan: AttentionPlan, scale):
    """This rank's (output (B, l, N, H), log-sum-exp (B, l, N)) with key/value gathered, on
    reference attention: for an ``out_transform`` (gpt_oss's sinks) that needs a differentiable
    log-sum-exp, which the fused kernel does not return. The mask is the plan's over the whole
    sequence, cut to this rank's query rows."""
    B, l, N, H = q_BlNH.shape
    L = l * cp.world_size
    natural = spmd_typing.replicated_metadata(_natural_order_index(cp.balanced_order, q_BlNH.device))
    gathered = kv_gathered(q_BlNH, k_BlNH, cp)
    k_BLNH, v_BLNH = (_whole_sequence_BLNH(x_BlNH, cp, natural, gathered) for x_BlNH in (k_BlNH, v_BlNH))
    with spmd_typing.opaque_kernel():  # a typing boundary, as the fused kernel's
        local = torch.tensor(cp.local_positions, dtype=torch.long, device=q_BlNH.device)
        keep_B1lL = plan_keep_mask(plan, B, L, L, q_BlNH.device).index_select(2, local)
        out_BlNH, lse_BlN = reference_attention_BLNH(q_BlNH, k_BLNH, v_BLNH, keep_B1lL, scale)
    return spmd_typing.type_like(out_BlNH, q_BlNH), spmd_typing.type_like(lse_BlN, q_BlNH, keep_dims=3)
