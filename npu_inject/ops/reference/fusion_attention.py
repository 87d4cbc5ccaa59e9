"""Reference ``torch_npu.npu_fusion_attention`` (and v3): the layouts and sparse modes npu_inject uses.

:mod:`npu_inject.ops.attention` calls the kernel with BSND (one sequence per row) or
TND (packed documents) and sparse_mode 0 without a mask (full attention), 2/3
(causal) or 4 (sliding-window band). The reference implements those, BNSD (BSND's
transpose), and the explicit masks of modes 0/1, which are the kernel's base
semantics; every mode is tested against SDPA or explicit loops
(tests/unit/ops/test_fusion_attention.py). Documented arguments nothing here calls
(BSH/SBH layouts, pse, prefix and sparse_mode 5-8, dropout) raise
NotImplementedError naming the argument. ``verification/torch_npu_docs.md`` digests the
documented semantics. ``npu_fusion_attention_v3`` is the same kernel with the TND
lengths as CPU tensors (what npu_inject passes for packed documents), computed by v1.

Scores are computed by tiles with an online softmax (flash attention), forward and backward,
so the CPU rehearsal's memory grows linearly with the sequence length; the backward recomputes
each tile from the saved softmax statistics. torch's own CPU flash attention (SDPA) is not used:
it returns only the log-sum-exp (torch_npu returns max and sum), has no band or right-down causal
mask, and would read an explicit mask as a dense (S x S) tensor.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence

import torch

from npu_inject.ops.reference._dtypes import FLOAT_DTYPES, compute_dtype

_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_IMPLEMENTED_LAYOUTS = ("BSND", "BNSD", "TND")
_IMPLEMENTED_SPARSE_MODES = (0, 1, 2, 3, 4)
# Modes 2/3/4 take one compressed 2048x2048 mask and derive the real one from the lengths.
_COMPRESSED_SIDE = 2048


@functools.lru_cache(maxsize=4)
def _expected_compressed_mask(device: str) -> torch.Tensor:
    ones = torch.ones(_COMPRESSED_SIDE, _COMPRESSED_SIDE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def _check_compressed_mask(atten_mask: torch.Tensor, sparse_mode: int) -> None:
    side = _COMPRESSED_SIDE
    shape = tuple(atten_mask.shape)
    if len(shape) < 2 or shape[-2:] != (side, side) or atten_mask.numel() != side * side:
        raise ValueError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} takes the compressed atten_mask of shape "
            f"({side}, {side}), got {shape}; the kernel derives the mask for any sequence length from "
            "sparse_mode, so pass the compressed mask, not one sized to the sequence"
        )
    if not torch.equal(atten_mask.reshape(side, side).bool(), _expected_compressed_mask(str(atten_mask.device))):
        raise ValueError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} expects the compressed atten_mask "
            "torch.triu(torch.ones(2048, 2048), diagonal=1).bool() (True = masked out); the given mask has "
            "the right shape but different contents"
        )


# Diagonal bands: a sparse mode keeps key j for query i iff lo <= j - i <= hi (None: unbounded).
_Band = tuple[Optional[int], Optional[int]]

# Scores are computed in tiles of (TILE, TILE) per (batch, head): the budget below bounds one
# tile's score block over all rows, so memory stays linear in the sequence length.
_TILE_SCORE_ELEMENTS = 1 << 23
_TILE_MIN, _TILE_MAX = 32, 512
# Tests set this to force small tiles whose side does not divide the sequence length.
TILE_SIDE: Optional[int] = None


def _tile_side(rows: int) -> int:
    """Query/key tile side for ``rows`` = B * N score rows (a power of two in [32, 512])."""
    if TILE_SIDE is not None:
        return TILE_SIDE
    side = _TILE_MIN
    while side < _TILE_MAX and rows * (2 * side) ** 2 <= _TILE_SCORE_ELEMENTS:
        side *= 2
    return side


def _band(sparse_mode: int, sq: int, skv: int, pre: int, nxt: int) -> _Band:
    """The diagonals sparse_mode keeps, as bounds on j - i; (None, None): everything.

    "Left-up" counts the diagonal from (0, 0), "right-down" from the bottom-right
    corner (docs, sparse_mode table).
    """
    if sparse_mode == 0:
        if pre >= sq and nxt >= skv:
            return None, None
        return -pre, nxt
    if sparse_mode == 1:
        return None, None
    if sparse_mode == 2:
        return None, 0
    shift = skv - sq
    if sparse_mode == 3:
        return None, shift
    return shift - pre, shift + nxt  # 4


def _tile_mask(band: _Band, explicit, rows: tuple[int, int], cols: tuple[int, int], device):
    """What to mask in the tile rows x cols (True = masked): None for nothing, False to skip the tile.

    ``explicit`` is the grouped (B|1, K|1, G|1, Sq, Skv) atten_mask or None.
    """
    (i0, i1), (j0, j1) = rows, cols
    lo, hi = band
    nearest, farthest = j0 - (i1 - 1), (j1 - 1) - i0  # smallest and largest j - i in the tile
    if (lo is not None and farthest < lo) or (hi is not None and nearest > hi):
        return False
    masked = None
    if (lo is not None and nearest < lo) or (hi is not None and farthest > hi):
        diagonal = torch.arange(j0, j1, device=device).unsqueeze(0) - torch.arange(i0, i1, device=device).unsqueeze(1)
        masked = torch.zeros_like(diagonal, dtype=torch.bool)
        if lo is not None:
            masked |= diagonal < lo
        if hi is not None:
            masked |= diagonal > hi
    if explicit is not None:
        tile = explicit[..., i0:i1, j0:j1]
        masked = tile if masked is None else (tile | masked)
    return masked


def _tiles(length: int, side: int):
    return [(start, min(start + side, length)) for start in range(0, length, side)]


class _BlockwiseAttention(torch.autograd.Function):
    """softmax(scale * q k^T, masked) v by tiles with an online softmax (flash attention).

    Grouped layouts: q (B, K, G, Sq, D), k/v (B, K, 1, Skv, D|Dv), query heads h = kv_head * G + j
    sharing kv_head (torch_npu / repeat_interleave order), so K and V are never repeated.
    Forward keeps only the per-row max and sum (torch_npu's softmax_max / softmax_sum); the
    backward recomputes each tile's probabilities from them, as npu_fusion_attention_grad does,
    so neither pass holds more than one tile of scores. A row with nothing to attend to
    outputs 0, its statistics are 0 and its gradients 0.
    ``sink`` (1, K, G, 1, 1) or None: one more logit per query head, in every row's softmax with a
    zero value (gpt_oss's attention sinks); the statistics include it, so such a row is never dead.
    Forward and setup_context are separate so torch.func.vjp (the compiled op's backward) runs it.
    """

    @staticmethod
    def forward(q, k, v, explicit, band, scale, side, sink):
        b, nkv, g, sq, _ = q.shape
        skv, dv = k.shape[3], v.shape[-1]
        out = q.new_zeros(b, nkv, g, sq, dv)
        row_max = q.new_zeros(b, nkv, g, sq, 1)
        row_sum = q.new_zeros(b, nkv, g, sq, 1)
        for rows in _tiles(sq, side):
            q_i = q[..., rows[0]:rows[1], :]
            m_i = q.new_full((b, nkv, g, rows[1] - rows[0], 1), float("-inf"))
            l_i = q.new_zeros(m_i.shape)
            acc_i = q.new_zeros(b, nkv, g, rows[1] - rows[0], dv)
            for cols in _tiles(skv, side):
                masked = _tile_mask(band, explicit, rows, cols, q.device)
                if masked is False:
                    continue
                s = torch.matmul(q_i, k[..., cols[0]:cols[1], :].transpose(-1, -2)) * scale
                if masked is not None:
                    s = s.masked_fill(masked, float("-inf"))
                m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
                # Rows still without a key keep max -inf: subtract 0 there, giving exp(-inf) = 0.
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
                p = torch.exp(s - m_safe)
                correction = torch.exp(m_i - m_safe)
                l_i = l_i * correction + p.sum(dim=-1, keepdim=True)
                acc_i = acc_i * correction + torch.matmul(p, v[..., cols[0]:cols[1], :])
                m_i = m_new
            if sink is not None:  # the sink's column: exp(sink - max) in the sum, nothing in the output
                m_new = torch.maximum(m_i, sink)
                correction = torch.exp(m_i - m_new)
                l_i = l_i * correction + torch.exp(sink - m_new)
                acc_i = acc_i * correction
                m_i = m_new
            # != rather than >: a NaN row stays NaN instead of passing for a dead row.
            live = m_i != float("-inf")
            out[..., rows[0]:rows[1], :] = torch.where(live, acc_i / torch.where(live, l_i, 1.0), 0.0)
            row_max[..., rows[0]:rows[1], :] = torch.where(live, m_i, 0.0)
            row_sum[..., rows[0]:rows[1], :] = l_i
        return out, row_max, row_sum

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, explicit, band, scale, side, sink = inputs
        out, row_max, row_sum = output
        ctx.band, ctx.scale, ctx.side = band, scale, side
        ctx.save_for_backward(q, k, v, explicit, out, row_max, row_sum, sink)
        ctx.mark_non_differentiable(row_max, row_sum)

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        q, k, v, explicit, out, row_max, row_sum, sink = ctx.saved_tensors
        band, scale, side = ctx.band, ctx.scale, ctx.side
        sq, skv = q.shape[3], k.shape[3]
        # exp(s - logsumexp) gives the probabilities; +inf on dead rows makes them 0.
        live = row_sum != 0  # dead rows have sum 0; a NaN row stays NaN
        lse = torch.where(live, row_max + torch.log(torch.where(live, row_sum, 1.0)), float("inf"))
        grad_out = grad_out.to(q.dtype)
        # D_i = sum_j P_ij dP_ij = rowsum(dO * O): the softmax backward's row term.
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows in _tiles(sq, side):
            r = slice(rows[0], rows[1])
            q_i, do_i, lse_i, delta_i = q[..., r, :], grad_out[..., r, :], lse[..., r, :], delta[..., r, :]
            for cols in _tiles(skv, side):
                masked = _tile_mask(band, explicit, rows, cols, q.device)
                if masked is False:
                    continue
                c = slice(cols[0], cols[1])
                k_j, v_j = k[..., c, :], v[..., c, :]
                s = torch.matmul(q_i, k_j.transpose(-1, -2)) * scale
                if masked is not None:
                    s = s.masked_fill(masked, float("-inf"))
                p = torch.exp(s - lse_i)
                # Query heads of one group share k_j / v_j: their contributions sum over G.
                grad_v[..., c, :] += torch.matmul(p.transpose(-1, -2), do_i).sum(dim=2, keepdim=True)
                grad_s = p * (torch.matmul(do_i, v_j.transpose(-1, -2)) - delta_i) * scale
                grad_q[..., r, :] += torch.matmul(grad_s, k_j)
                grad_k[..., c, :] += torch.matmul(grad_s.transpose(-1, -2), q_i).sum(dim=2, keepdim=True)
        grad_sink = None
        if sink is not None and ctx.needs_input_grad[7]:
            # The sink column's value is 0: its score gradient is p_sink * (0 - D), summed over batch and rows.
            grad_sink = -(torch.exp(sink - lse) * delta).sum(dim=(0, 3), keepdim=True)
        return grad_q, grad_k, grad_v, None, None, None, None, grad_sink


def _attention_core(q_BNSD, k_BKSD, v_BKSD, explicit: Optional[torch.Tensor], band: _Band, scale: float,
                    sink_N: Optional[torch.Tensor] = None):
    """softmax(scale * q k^T, masked) v, with GQA by grouping query heads, computed by tiles.

    Masked: ``explicit`` (4-D, broadcastable to (B, N, Sq, Skv), True = masked; or None) and
    everything outside the diagonals ``band``. ``sink_N``: one extra logit per query head (or None).
    Returns (out_BNSD in the compute dtype, softmax_max_BNS, softmax_sum_BNS).
    """
    b, n, sq, d = q_BNSD.shape
    nkv, skv = k_BKSD.shape[1], k_BKSD.shape[2]
    g = n // nkv
    cdt = compute_dtype(q_BNSD.dtype)
    if skv == 0 and sink_N is None:
        # No keys at all: every row is a fully masked row (output 0, still in the graph).
        zeros_BNS = q_BNSD.new_zeros(b, n, sq, dtype=cdt)
        out_BNSD = (q_BNSD.to(cdt).sum(-1, keepdim=True) * 0).expand(b, n, sq, v_BKSD.shape[-1])
        return out_BNSD, zeros_BNS, zeros_BNS
    q_BKGSD = q_BNSD.to(cdt).reshape(b, nkv, g, sq, d)
    k_BK1SD, v_BK1SD = (t.to(cdt).unsqueeze(2) for t in (k_BKSD, v_BKSD))
    explicit_BKGSS = None
    if explicit is not None:
        # (B|1, N|1, Sq, Skv) -> (B|1, Nkv|1, G|1, Sq, Skv), matching the grouped scores.
        if explicit.shape[1] == n:
            explicit_BKGSS = explicit.reshape(explicit.shape[0], nkv, g, *explicit.shape[2:])
        else:
            explicit_BKGSS = explicit.unsqueeze(2)
    sink_1KG11 = None if sink_N is None else sink_N.to(cdt).reshape(1, nkv, g, 1, 1)
    out_BKGSD, max_BKGS1, sum_BKGS1 = _BlockwiseAttention.apply(
        q_BKGSD, k_BK1SD, v_BK1SD, explicit_BKGSS, band, float(scale), _tile_side(b * n), sink_1KG11
    )
    # softmax_max / softmax_sum are backward-only buffers on the NPU; no gradient flows
    # through them there, so they are non-differentiable here too.
    return (out_BKGSD.reshape(b, n, sq, v_BKSD.shape[-1]), max_BKGS1.reshape(b, n, sq),
            sum_BKGS1.reshape(b, n, sq))


def _check_heads(fn: str, n: int, nkv: int, q, k, v) -> None:
    if nkv == 0 or n % nkv:
        raise ValueError(
            f"{fn}: query has {n} heads and key {nkv}; the query head count must be a positive multiple of the "
            "key/value head count (GQA)"
        )
    if v.shape[1] != nkv or v.shape[-2] != k.shape[-2] or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"{fn}: key and value must share batch, sequence and head counts with each other (and batch with query)"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[-1] < v.shape[-1]:
        raise ValueError(
            f"{fn}: head dims must satisfy Dq == Dk >= Dv, got Dq={q.shape[-1]}, Dk={k.shape[-1]}, Dv={v.shape[-1]}"
        )


def _full_mask_4d(atten_mask: torch.Tensor, b: int, n: int, sq: int, skv: int, sparse_mode: int) -> torch.Tensor:
    """A BNSS / B1SS / 11SS / SS mask as a 4-D bool tensor broadcastable to (B, N, Sq, Skv)."""
    mask = atten_mask.bool()
    if mask.dim() == 2:
        mask = mask.reshape(1, 1, *mask.shape)
    fits = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] in (1, n)
    if not fits or tuple(mask.shape[2:]) != (sq, skv):
        raise ValueError(
            f"npu_fusion_attention: atten_mask shape {tuple(atten_mask.shape)} does not fit sparse_mode="
            f"{sparse_mode} with B={b}, N={n}, Sq={sq}, Skv={skv}; use one of BNSS, B1SS, 11SS or SS"
        )
    return mask


def _varlen_bounds(cumulative: Sequence[int], name: str, total: int) -> list[tuple[int, int]]:
    """Cumulative end offsets -> [(start, end)] of the participating sequences.

    A run of trailing zeros after a positive offset marks batches that do not take part
    (docs: "[2, 5, 9, 0, 0]").
    """
    values = [int(v) for v in cumulative]
    if not values:
        raise ValueError(f"npu_fusion_attention: {name} must be a non-empty list of cumulative lengths")
    active = len(values)
    while active > 0 and values[active - 1] == 0 and any(v > 0 for v in values[: active - 1]):
        active -= 1
    bounds, previous = [], 0
    for v in values[:active]:
        if v < previous:
            raise ValueError(
                f"npu_fusion_attention: {name}={list(cumulative)} must hold non-decreasing cumulative end offsets "
                "(lengths 2, 2, 2 -> [2, 4, 6]), optionally followed by zeros for skipped batches"
            )
        bounds.append((previous, v))
        previous = v
    if previous > total:
        raise ValueError(f"npu_fusion_attention: {name} ends at {previous}, beyond the {total} tokens of the TND input")
    return bounds


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    atten_mask: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Optional[Sequence[int]] = None,
    actual_seq_qlen: Optional[Sequence[int]] = None,
    actual_seq_kvlen: Optional[Sequence[int]] = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: Optional[torch.Tensor] = None,
):
    """Reference for ``torch_npu.npu_fusion_attention``.

    Computes ``softmax(mask(scale * query @ key^T, atten_mask)) @ value`` and returns
    ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:

    - ``attention_out``: query's layout and dtype, head dim of value.
    - ``softmax_max`` / ``softmax_sum``: float32, (B, N, Sq, 8), or (T, N, 8) for TND, the
      row max of the scaled, masked scores and the sum of ``exp(score - max)``, repeated
      over the last axis of 8. For TND the default ``softmax_layout=""`` fills the (T, N, 8)
      buffer in N-major (NTD) order, ``softmax_layout="TND"`` in token-major order.
      Detached: torch_npu's backward takes no gradient through them.
    - ``softmax_out``: empty tensor of query's dtype (reserved).
    - ``seed``, ``offset``, ``numels``: ints, 0 since no dropout mask is generated.

    Layouts: BSND, BNSD, TND (TND needs ``actual_seq_qlen``/``actual_seq_kvlen`` as
    cumulative end offsets). GQA: key/value may carry fewer heads than ``head_num``.

    Masking (True = masked out). With ``atten_mask=None`` nothing is masked whatever
    ``sparse_mode`` and the tockens say (the docs: "fixed to full computation"); a warning
    flags ``sparse_mode != 0`` without a mask. Otherwise, per sequence:

    - 0: ``atten_mask`` (BNSS/B1SS/11SS/SS; SS for TND) plus the band
      ``-pre_tockens <= j - i <= next_tockens``;
    - 1: ``atten_mask`` alone;
    - 2: left-up causal ``j <= i``; 3: right-down causal ``j - i <= Skv - Sq``;
    - 4: the band counted from the bottom-right corner.

    ``sink``: float32 (head_num,), one more logit per query head in every row's softmax, its column
    dropped before ``value`` (torch_npu's example; gpt_oss's attention sinks): the output is the
    sink-less one times ``sigmoid(lse - sink)``. The statistics include it; its gradient comes back
    through autograd, as ``dsink`` from torch_npu's backward.

    Modes 2, 3, 4 take the compressed mask ``torch.triu(torch.ones(2048, 2048), 1).bool()``;
    its shape and contents are checked, and the effective mask is derived from the mode and
    sequence lengths, never sliced from it.

    A query row left with no key (e.g. sparse_mode 3 with Sq > Skv) outputs 0, its
    softmax_max and softmax_sum are 0, and its gradients are 0. TND tokens past the last
    participating sequence also output 0.

    Not implemented (NotImplementedError): ``keep_prob < 1`` (dropout draws from the NPU's
    Philox stream, which a CPU cannot reproduce), the BSH/SBH layouts, ``pse``, ``prefix``
    and sparse_mode 5-8: npu_inject calls none of them.
    """
    fn = "npu_fusion_attention"
    if input_layout not in _LAYOUTS:
        raise ValueError(f"{fn}: input_layout={input_layout!r} is not supported; use one of {', '.join(_LAYOUTS)}")
    if input_layout not in _IMPLEMENTED_LAYOUTS:
        raise NotImplementedError(
            f"{fn}: input_layout={input_layout!r} is not implemented in the reference; use one of "
            f"{', '.join(_IMPLEMENTED_LAYOUTS)}"
        )
    if not (0.0 < keep_prob <= 1.0):
        raise ValueError(f"{fn}: keep_prob={keep_prob} is out of range; use a value in (0, 1]")
    if keep_prob < 1.0:
        raise NotImplementedError(
            f"{fn}: keep_prob={keep_prob} < 1 (dropout) is not implemented in the reference: the dropout mask "
            "comes from the NPU's Philox RNG stream (seed/offset), which cannot be reproduced on CPU; use keep_prob=1"
        )
    if padding_mask is not None:
        raise ValueError(f"{fn}: padding_mask is reserved and not supported by torch_npu; pass None")
    if inner_precise not in (0, 1, 2):
        raise ValueError(f"{fn}: inner_precise={inner_precise} is not supported; use 0, 1 (reserved) or 2")
    if sparse_mode not in range(9):
        raise ValueError(f"{fn}: sparse_mode={sparse_mode} is not supported; use 0-8")
    if sparse_mode not in _IMPLEMENTED_SPARSE_MODES:
        raise NotImplementedError(
            f"{fn}: sparse_mode={sparse_mode} (prefix / varlen split across cards) is not implemented in the "
            "reference; use 0-4"
        )
    for name, argument in (("pse", pse), ("prefix", prefix)):
        if argument is not None:
            raise NotImplementedError(f"{fn}: {name} is not implemented in the reference; pass None")
    if softmax_layout not in ("", "TND") or (softmax_layout == "TND" and input_layout != "TND"):
        raise ValueError(
            f"{fn}: softmax_layout={softmax_layout!r} is not supported with input_layout={input_layout!r}; "
            "use '' (or 'TND' when input_layout='TND')"
        )
    if query.dtype not in FLOAT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"{fn}: query/key/value dtypes ({query.dtype}, {key.dtype}, {value.dtype}) must be equal and one of "
            "float16, bfloat16, float32"
        )
    head_num = int(head_num)
    if head_num <= 0:
        raise ValueError(f"{fn}: head_num={head_num} must be positive (the query head count)")
    varlen = input_layout == "TND"
    if not varlen and (actual_seq_qlen is not None or actual_seq_kvlen is not None):
        raise ValueError(
            f"{fn}: actual_seq_qlen/actual_seq_kvlen only apply to input_layout='TND', got {input_layout!r}"
        )
    if sink is not None and (sink.dim() != 1 or sink.shape[0] != head_num or sink.dtype != torch.float32):
        raise ValueError(
            f"{fn}: sink must be a 1-D float32 tensor of head_num={head_num} logits, got "
            f"{tuple(sink.shape)} {sink.dtype}"
        )
    if atten_mask is None and sparse_mode != 0:
        warnings.warn(
            f"{fn}: sparse_mode={sparse_mode} with atten_mask=None computes full (unmasked) attention, as on "
            "the NPU; pass the compressed mask torch.triu(torch.ones(2048, 2048), diagonal=1).bool()",
            stacklevel=2,
        )
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(
                f"{fn}: atten_mask dtype {atten_mask.dtype} is not supported; use torch.bool or torch.uint8 "
                "(True/1 = masked out)"
            )
        if sparse_mode in (2, 3, 4):
            _check_compressed_mask(atten_mask, sparse_mode)
        if sparse_mode in (0, 4) and pre_tockens + next_tockens < 0:
            raise ValueError(
                f"{fn}: pre_tockens={pre_tockens} and next_tockens={next_tockens} leave an empty band; "
                "they must satisfy pre_tockens + next_tockens >= 0"
            )

    if varlen:
        attention_out, softmax_max, softmax_sum = _varlen_attention(
            fn, query, key, value, head_num, atten_mask, scale, pre_tockens, next_tockens,
            actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink,
        )
    else:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(
                    f"{fn}: input_layout={input_layout!r} takes 4-D {name}, got shape {tuple(t.shape)}"
                )
        q_BNSD, k_BKSD, v_BKSD = (t.transpose(1, 2) if input_layout == "BSND" else t for t in (query, key, value))
        b, n, sq, _ = q_BNSD.shape
        nkv, skv = k_BKSD.shape[1], k_BKSD.shape[2]
        if n != head_num:
            raise ValueError(f"{fn}: head_num={head_num} but query has {n} heads in layout {input_layout}")
        _check_heads(fn, n, nkv, q_BNSD, k_BKSD, v_BKSD)
        explicit, band = None, (None, None)
        if atten_mask is not None:
            if sparse_mode in (0, 1):
                explicit = _full_mask_4d(atten_mask, b, n, sq, skv, sparse_mode)
            band = _band(sparse_mode, sq, skv, pre_tockens, next_tockens)
        out_BNSD, smax_BNS, ssum_BNS = _attention_core(q_BNSD, k_BKSD, v_BKSD, explicit, band, scale, sink)
        out_BNSD = out_BNSD.to(query.dtype)
        attention_out = out_BNSD.transpose(1, 2) if input_layout == "BSND" else out_BNSD
        softmax_max = smax_BNS.float().unsqueeze(-1).expand(b, n, sq, 8).contiguous()
        softmax_sum = ssum_BNS.float().unsqueeze(-1).expand(b, n, sq, 8).contiguous()
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return attention_out, softmax_max, softmax_sum, softmax_out, 0, 0, 0


def _varlen_attention(
    fn, query, key, value, head_num, atten_mask, scale, pre_tockens, next_tockens,
    actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink=None,
):
    """TND: every packed sequence attends on its own, with its own Sq and Skv."""
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise ValueError(
            f"{fn}: input_layout='TND' needs actual_seq_qlen and actual_seq_kvlen (cumulative end offsets)"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(f"{fn}: input_layout='TND' takes 3-D {name}, got shape {tuple(t.shape)}")
    t_q, n, _ = query.shape
    t_kv, nkv, _ = key.shape
    if n != head_num:
        raise ValueError(f"{fn}: head_num={head_num} but query has {n} heads in layout TND")
    if value.shape[0] != t_kv:
        raise ValueError(f"{fn}: key and value must have the same token count, got {t_kv} and {value.shape[0]}")
    # (1, N, T, D) views reuse the BNSD checks.
    _check_heads(fn, n, nkv, *(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)))
    q_bounds = _varlen_bounds(actual_seq_qlen, "actual_seq_qlen", t_q)
    kv_bounds = _varlen_bounds(actual_seq_kvlen, "actual_seq_kvlen", t_kv)
    if len(q_bounds) != len(kv_bounds):
        raise ValueError(
            f"{fn}: actual_seq_qlen and actual_seq_kvlen describe {len(q_bounds)} and {len(kv_bounds)} sequences; "
            "they must describe the same batches"
        )
    if atten_mask is not None and sparse_mode in (0, 1):
        max_q = max(e - s for s, e in q_bounds)
        max_kv = max(e - s for s, e in kv_bounds)
        if atten_mask.dim() != 2 or atten_mask.shape[0] < max_q or atten_mask.shape[1] < max_kv:
            raise ValueError(
                f"{fn}: with input_layout='TND' atten_mask must be 2-D and at least (maxSq, maxSkv) = "
                f"({max_q}, {max_kv}), got {tuple(atten_mask.shape)}"
            )

    dv = value.shape[-1]
    cdt = compute_dtype(query.dtype)
    pieces = []
    smax_NT = torch.zeros(n, t_q, dtype=torch.float32, device=query.device)
    ssum_NT = torch.zeros(n, t_q, dtype=torch.float32, device=query.device)
    covered = 0
    for (qs, qe), (ks, ke) in zip(q_bounds, kv_bounds):
        sq, skv = qe - qs, ke - ks
        if sq == 0:
            continue
        explicit, band = None, (None, None)
        if atten_mask is not None:
            if sparse_mode in (0, 1):
                explicit = atten_mask[:sq, :skv].bool().reshape(1, 1, sq, skv)
            band = _band(sparse_mode, sq, skv, pre_tockens, next_tockens)
        q_1NSD = query[qs:qe].transpose(0, 1).unsqueeze(0)
        k_1KSD, v_1KSD = (t[ks:ke].transpose(0, 1).unsqueeze(0) for t in (key, value))
        out_1NSD, smax_1NS, ssum_1NS = _attention_core(q_1NSD, k_1KSD, v_1KSD, explicit, band, scale, sink)
        pieces.append(out_1NSD[0].transpose(0, 1))
        smax_NT[:, qs:qe] = smax_1NS[0].float()
        ssum_NT[:, qs:qe] = ssum_1NS[0].float()
        covered = qe
    if covered < t_q:
        pieces.append(query.new_zeros(t_q - covered, n, dv, dtype=cdt))
    attention_out = torch.cat(pieces, dim=0).to(query.dtype) if pieces else query.new_zeros(t_q, n, dv)
    if softmax_layout == "TND":
        smax, ssum = smax_NT.t(), ssum_NT.t()
    else:
        # Default NTD order written into the documented (T, N, 8) buffer.
        smax, ssum = smax_NT.reshape(t_q, n), ssum_NT.reshape(t_q, n)
    softmax_max = smax.unsqueeze(-1).expand(t_q, n, 8).contiguous()
    softmax_sum = ssum.unsqueeze(-1).expand(t_q, n, 8).contiguous()
    return attention_out, softmax_max, softmax_sum


def _host_cumulative_lengths(name: str, lengths: Optional[torch.Tensor]) -> Optional[list[int]]:
    """A v3 length tensor as the host list npu_fusion_attention takes (None stays None).

    torch_npu's v3 kernel reads the tensor's memory on the host (op-plugin's ToIntArrayRef:
    "tensor must be on CPU", 1-D; int64 is read in place, other integer dtypes are converted).
    """
    if lengths is None:
        return None
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(
            f"npu_fusion_attention_v3: {name} must be a 1-D CPU integer tensor of cumulative end offsets, "
            f"got {type(lengths).__name__}; npu_fusion_attention (v1) is the variant taking a list"
        )
    if lengths.device.type != "cpu" or lengths.dim() != 1 or lengths.dtype.is_floating_point \
            or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(
            f"npu_fusion_attention_v3: {name} must be a 1-D CPU integer tensor (torch_npu reads it on the host), "
            f"got a {lengths.dim()}-D {lengths.dtype} tensor on {lengths.device}; pass e.g. "
            "cu_seqlens[1:].to('cpu', torch.int64)"
        )
    return lengths.tolist()


def fusion_attention_v3_via(v1, query, key, value, head_num, input_layout, *, actual_seq_qlen=None,
                            actual_seq_kvlen=None, sink=None, **arguments):
    """npu_fusion_attention_v3 computed by ``v1`` (an npu_fusion_attention: the reference, or
    selective AC's dispatcher op): the length tensors read to host lists, seed/offset as tensors."""
    if sink is not None:  # only then: v1 may be a dispatcher op whose schema predates it
        arguments["sink"] = sink
    attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, _ = v1(
        query, key, value, head_num, input_layout,
        actual_seq_qlen=_host_cumulative_lengths("actual_seq_qlen", actual_seq_qlen),
        actual_seq_kvlen=_host_cumulative_lengths("actual_seq_kvlen", actual_seq_kvlen), **arguments,
    )
    seed_1, offset_1 = (torch.full((1,), value, dtype=torch.int64, device=query.device) for value in (seed, offset))
    return attention_out, softmax_max, softmax_sum, softmax_out, seed_1, offset_1


def npu_fusion_attention_v3(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    atten_mask: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Optional[Sequence[int]] = None,
    actual_seq_qlen: Optional[torch.Tensor] = None,
    actual_seq_kvlen: Optional[torch.Tensor] = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: Optional[torch.Tensor] = None,
):
    """Reference for ``torch_npu.npu_fusion_attention_v3``: :func:`npu_fusion_attention` with tensor lengths.

    The same computation and arguments as v1, except that ``actual_seq_qlen`` and
    ``actual_seq_kvlen`` are 1-D CPU integer tensors (read on the host inside the
    kernel, so under torch.compile the document boundaries are data, not constants
    of the graph), and the six outputs are all tensors: ``(attention_out, softmax_max,
    softmax_sum, softmax_out, seed, offset)``, seed and offset int64 of shape (1,) on
    query's device (torch_npu's fake registration), 0 since no dropout mask is drawn.
    ``sink`` as in v1.
    """
    return fusion_attention_v3_via(
        npu_fusion_attention, query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tockens=pre_tockens,
        next_tockens=next_tockens, inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel,
        sync=sync, softmax_layout=softmax_layout, sink=sink,
    )
