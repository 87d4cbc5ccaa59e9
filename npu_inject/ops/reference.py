"""Plain-PyTorch reference implementations of the torch_npu kernels the patches call.

Each function carries torch_npu 2.14.0's name, parameter names, defaults and return
structure, so a caller can swap ``torch_npu`` and this module (see
:func:`npu_inject.ops.kernels`). Semantics follow the wheel's ``_op_plugin_docs.py`` and
``op_plugin/meta/_meta_registrations.py``; ``tools/torch_npu_docs.md`` digests them.

Forward and backward both go through ordinary torch autograd. Half-precision inputs are
computed in float32 and cast back. float64 inputs are accepted (computed in float64) so
that tests can run ``gradcheck``; torch_npu itself takes float16/bfloat16/float32 only.

Where torch_npu accepts an argument whose behaviour is device specific (dropout RNG) or
that the project does not need (quantized grouped matmul), the reference raises
``NotImplementedError`` naming the argument rather than computing something different.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence, Union

import torch

__all__ = [
    "npu_fusion_attention",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_TOCKENS_DEFAULT = 2147483647
# The compressed masks of sparse_mode 2/3/4/7/8 (2048x2048) and 6 (3072x2048).
_COMPRESSED_SIDE = 2048
_PREFIX_COMPRESSED_ROWS = 3072


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 for gradcheck; everything else accumulates in float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------
# npu_fusion_attention
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _expected_compressed_mask(rows: int, device: str) -> torch.Tensor:
    side = _COMPRESSED_SIDE
    causal = torch.triu(torch.ones(side, side, dtype=torch.bool, device=device), diagonal=1)
    if rows == side:
        return causal
    # sparse_mode 6: the causal square on top of a 1024x2048 block, left half 0, right half 1.
    rect = torch.zeros(rows - side, side, dtype=torch.bool, device=device)
    rect[:, side // 2 :] = True
    return torch.cat([causal, rect], dim=0)


def _check_compressed_mask(atten_mask: Optional[torch.Tensor], sparse_mode: int) -> None:
    if atten_mask is None:
        return
    rows = _PREFIX_COMPRESSED_ROWS if sparse_mode == 6 else _COMPRESSED_SIDE
    shape = tuple(atten_mask.shape)
    if len(shape) < 2 or shape[-2:] != (rows, _COMPRESSED_SIDE) or atten_mask.numel() != rows * _COMPRESSED_SIDE:
        raise ValueError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} takes the compressed atten_mask of shape "
            f"({rows}, {_COMPRESSED_SIDE}), got {shape}; the kernel derives the mask for any sequence "
            "length from sparse_mode, so pass the compressed mask, not one sized to the sequence"
        )
    expected = _expected_compressed_mask(rows, str(atten_mask.device))
    if not torch.equal(atten_mask.reshape(rows, _COMPRESSED_SIDE).bool(), expected):
        hint = "torch.triu(torch.ones(2048, 2048), diagonal=1).bool()"
        if sparse_mode == 6:
            hint += " stacked on a (1024, 2048) block whose right half is True"
        raise ValueError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} expects the compressed atten_mask {hint} "
            "(True = masked out); the given mask has the right shape but different contents"
        )


def _band_mask(sq: int, skv: int, pre: int, nxt: int, right_down: bool, device) -> torch.Tensor:
    """True where (i, j) lies outside the pre_tockens/next_tockens band."""
    i_S1 = torch.arange(sq, device=device).unsqueeze(1)
    j_1S = torch.arange(skv, device=device).unsqueeze(0)
    # Band origin: top-left for sparse_mode 0, bottom-right for 4/7/8 (docs, sparse_mode table).
    diag_SS = j_1S - i_S1 - ((skv - sq) if right_down else 0)
    return (diag_SS > nxt) | (diag_SS < -pre)


def _region_mask(
    sparse_mode: int,
    sq: int,
    skv: int,
    pre: int,
    nxt: int,
    prefix_n: Optional[int],
    is_first: bool,
    is_last: bool,
    device,
) -> Optional[torch.Tensor]:
    """The part of the (sq, skv) score matrix sparse_mode leaves uncomputed (True = masked).

    None means sparse_mode itself masks nothing (the given atten_mask alone decides).
    """
    if sparse_mode == 0:
        if pre >= sq and nxt >= skv:
            return None
        return _band_mask(sq, skv, pre, nxt, right_down=False, device=device)
    if sparse_mode == 1:
        return None
    i_S1 = torch.arange(sq, device=device).unsqueeze(1)
    j_1S = torch.arange(skv, device=device).unsqueeze(0)
    if sparse_mode == 2 or (sparse_mode == 8 and not is_first):
        return j_1S > i_S1
    if sparse_mode == 3 or (sparse_mode == 7 and not is_last):
        return (j_1S - i_S1) > (skv - sq)
    if sparse_mode == 4 or sparse_mode in (7, 8):
        # Mode 7's last / mode 8's first sequence is the band left by cutting a causal
        # sequence across cards (docs, sparse_mode 7/8 examples).
        return _band_mask(sq, skv, pre, nxt, right_down=True, device=device)
    if sparse_mode in (5, 6):
        # rightDownCausal plus a full-height block over the first prefix_n key columns.
        return ((j_1S - i_S1) > (skv - sq)) & (j_1S >= prefix_n)
    raise AssertionError(sparse_mode)  # validated by the caller


def _to_5d(t: torch.Tensor, n: int, nkv: int) -> torch.Tensor:
    """(B|1, N|1, Sq|1, Skv) -> (B|1, Nkv|1, G|1, Sq|1, Skv) for GQA-grouped scores."""
    b, h, s, k = t.shape
    if h == n:
        return t.reshape(b, nkv, n // nkv, s, k)
    return t.unsqueeze(2)


def _attention_core(
    q_BNSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    masked: Optional[torch.Tensor],
    pse: Optional[torch.Tensor],
    scale: float,
):
    """softmax(scale * (q k^T + pse), masked) v, with GQA by grouping query heads.

    Returns (out_BNSD in the compute dtype, softmax_max_BNS, softmax_sum_BNS).
    ``masked`` and ``pse`` are 4-D and broadcastable to (B, N, Sq, Skv).
    """
    b, n, sq, d = q_BNSD.shape
    nkv, skv = k_BKSD.shape[1], k_BKSD.shape[2]
    g = n // nkv
    cdt = _compute_dtype(q_BNSD.dtype)
    if skv == 0:
        # No keys at all: every row is a fully masked row.
        zeros_BNS = q_BNSD.new_zeros(b, n, sq, dtype=cdt)
        out_BNSD = (q_BNSD.to(cdt).sum(-1, keepdim=True) * 0).expand(b, n, sq, v_BKSD.shape[-1])
        return out_BNSD, zeros_BNS, zeros_BNS
    # Query heads h = kv_head * g + j share kv_head (torch_npu / repeat_interleave order),
    # so grouping the query avoids materialising repeated K and V.
    q_BKGSD = q_BNSD.to(cdt).reshape(b, nkv, g, sq, d)
    k_BK1SD = k_BKSD.to(cdt).unsqueeze(2)
    v_BK1SD = v_BKSD.to(cdt).unsqueeze(2)
    s_BKGSS = torch.matmul(q_BKGSD, k_BK1SD.transpose(-1, -2))
    if pse is not None:
        s_BKGSS = s_BKGSS + _to_5d(pse.to(cdt), n, nkv)
    s_BKGSS = s_BKGSS * scale

    dead = None
    if masked is not None:
        m5 = _to_5d(masked, n, nkv)
        # Rows with nothing left to attend to get output 0, not NaN: keep their scores
        # finite through the softmax and zero the probabilities afterwards.
        dead = m5.all(dim=-1, keepdim=True)
        s_BKGSS = s_BKGSS.masked_fill(m5 & ~dead, float("-inf"))
    p_BKGSS = torch.softmax(s_BKGSS, dim=-1)
    if dead is not None:
        p_BKGSS = p_BKGSS.masked_fill(dead, 0.0)
    out_BKGSD = torch.matmul(p_BKGSS, v_BK1SD)
    out_BNSD = out_BKGSD.reshape(b, n, sq, v_BKSD.shape[-1])

    # softmax_max / softmax_sum are backward-only buffers on the NPU; no gradient flows
    # through them there, so they are detached here too.
    with torch.no_grad():
        smax = s_BKGSS.amax(dim=-1, keepdim=True)
        ssum = torch.exp(s_BKGSS - smax).sum(dim=-1, keepdim=True)
        if dead is not None:
            dead_b = dead.expand_as(smax)
            smax = smax.masked_fill(dead_b, 0.0)
            ssum = ssum.masked_fill(dead_b, 0.0)
        smax = smax.reshape(b, n, sq)
        ssum = ssum.reshape(b, n, sq)
    return out_BNSD, smax, ssum


def _split_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str
):
    """Views of q, k, v as (B, N, S, D) for the four non-varlen layouts."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        want = 3 if input_layout in ("BSH", "SBH") else 4
        if t.dim() != want:
            raise ValueError(
                f"npu_fusion_attention: input_layout={input_layout!r} takes {want}-D {name}, "
                f"got shape {tuple(t.shape)}"
            )
    if input_layout in ("BSH", "SBH"):
        hq, hk, hv = query.shape[2], key.shape[2], value.shape[2]
        if hq % head_num:
            raise ValueError(
                f"npu_fusion_attention: head_num={head_num} does not divide the query hidden size {hq}"
            )
        d = hq // head_num
        if hk % d or hk == 0:
            raise ValueError(
                f"npu_fusion_attention: key hidden size {hk} is not a multiple of the head dim {d} "
                f"(= query hidden {hq} / head_num {head_num})"
            )
        nkv = hk // d
        if hv % nkv:
            raise ValueError(
                f"npu_fusion_attention: value hidden size {hv} is not a multiple of the kv head count {nkv}"
            )

        def split(t: torch.Tensor, heads: int) -> torch.Tensor:
            if input_layout == "BSH":
                bb, ss, hh = t.shape
                return t.reshape(bb, ss, heads, hh // heads).transpose(1, 2)
            ss, bb, hh = t.shape
            return t.reshape(ss, bb, heads, hh // heads).permute(1, 2, 0, 3)

        return split(query, head_num), split(key, nkv), split(value, nkv)
    if input_layout == "BSND":
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return query, key, value  # BNSD


def _merge_heads(out_BNSD: torch.Tensor, input_layout: str) -> torch.Tensor:
    b, n, s, d = out_BNSD.shape
    if input_layout == "BSH":
        return out_BNSD.transpose(1, 2).reshape(b, s, n * d)
    if input_layout == "SBH":
        return out_BNSD.permute(2, 0, 1, 3).reshape(s, b, n * d)
    if input_layout == "BSND":
        return out_BNSD.transpose(1, 2)
    return out_BNSD


def _check_mask_dtype(atten_mask: torch.Tensor) -> None:
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(
            f"npu_fusion_attention: atten_mask dtype {atten_mask.dtype} is not supported; use torch.bool "
            "or torch.uint8 (True/1 = masked out)"
        )


def _full_mask_4d(atten_mask: torch.Tensor, b: int, n: int, sq: int, skv: int, sparse_mode: int) -> torch.Tensor:
    """A BNSS / B1SS / 11SS / SS mask as a 4-D bool tensor broadcastable to (B, N, Sq, Skv)."""
    m = atten_mask.bool()
    if m.dim() == 2:
        m = m.reshape(1, 1, *m.shape)
    ok = (
        m.dim() == 4
        and m.shape[0] in (1, b)
        and m.shape[1] in (1, n)
        and tuple(m.shape[2:]) == (sq, skv)
        and (sparse_mode != 5 or m.shape[0] == b)
    )
    if not ok:
        formats = "BNSS or B1SS" if sparse_mode == 5 else "BNSS, B1SS, 11SS or SS"
        raise ValueError(
            f"npu_fusion_attention: atten_mask shape {tuple(atten_mask.shape)} does not fit sparse_mode="
            f"{sparse_mode} with B={b}, N={n}, Sq={sq}, Skv={skv}; use one of {formats}"
        )
    return m


def _check_pse(pse: torch.Tensor, b: int, n: int, sq: int, skv: int, dtype: torch.dtype) -> None:
    if pse.dtype != dtype:
        raise ValueError(f"npu_fusion_attention: pse dtype {pse.dtype} must match query dtype {dtype}")
    ok = (
        pse.dim() == 4
        and pse.shape[0] in (1, b)
        and pse.shape[1] == n
        and pse.shape[2] in (1, sq)
        and pse.shape[3] == skv
    )
    if ok:
        return
    if pse.dim() == 4 and pse.shape[2] == 1024 and pse.shape[2] != sq:
        raise NotImplementedError(
            "npu_fusion_attention: the compressed alibi pse (last 1024 rows only) is not implemented in the "
            "reference; pass the full BNSS / BN1Skv / 1NSS pse"
        )
    raise ValueError(
        f"npu_fusion_attention: pse shape {tuple(pse.shape)} does not fit B={b}, N={n}, Sq={sq}, Skv={skv}; "
        "use BNSS, BN1Skv or 1NSS"
    )


def _varlen_bounds(cum: Sequence[int], name: str, total: int) -> list[tuple[int, int]]:
    """Cumulative end offsets -> [(start, end)] of the participating sequences.

    A run of trailing zeros after a positive offset marks batches that do not take part
    (docs: "[2, 5, 9, 0, 0]").
    """
    values = [int(v) for v in cum]
    if not values:
        raise ValueError(f"npu_fusion_attention: {name} must be a non-empty list of cumulative lengths")
    active = len(values)
    while active > 0 and values[active - 1] == 0 and any(v > 0 for v in values[: active - 1]):
        active -= 1
    values = values[:active]
    bounds = []
    prev = 0
    for v in values:
        if v < prev:
            raise ValueError(
                f"npu_fusion_attention: {name}={list(cum)} must hold non-decreasing cumulative end offsets "
                "(lengths 2, 2, 2 -> [2, 4, 6]), optionally followed by zeros for skipped batches"
            )
        bounds.append((prev, v))
        prev = v
    if prev > total:
        raise ValueError(
            f"npu_fusion_attention: {name} ends at {prev}, beyond the {total} tokens of the TND input"
        )
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
):
    """Reference for ``torch_npu.npu_fusion_attention``.

    Computes ``softmax(mask(scale * (query @ key^T + pse), atten_mask)) @ value`` and
    returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:

    - ``attention_out``: query's layout and dtype, head dim of value.
    - ``softmax_max`` / ``softmax_sum``: float32, (B, N, Sq, 8), or (T, N, 8) for TND, the
      row max of the scaled, masked scores and the sum of ``exp(score - max)``, repeated
      over the last axis of 8. For TND the default ``softmax_layout=""`` fills the (T, N, 8)
      buffer in N-major (NTD) order, ``softmax_layout="TND"`` in token-major order.
      Detached: torch_npu's backward takes no gradient through them.
    - ``softmax_out``: empty tensor of query's dtype (reserved).
    - ``seed``, ``offset``, ``numels``: ints, 0 since no dropout mask is generated.

    Layouts: BSH, SBH, BSND, BNSD, TND (TND needs ``actual_seq_qlen``/``actual_seq_kvlen``
    as cumulative end offsets). GQA: key/value may carry fewer heads than ``head_num``.

    Masking (True = masked out). With ``atten_mask=None`` nothing is masked whatever
    ``sparse_mode`` and the tockens say (the docs: "fixed to full computation"); a warning
    flags ``sparse_mode != 0`` without a mask. Otherwise, per sequence:

    - 0: ``atten_mask`` (BNSS/B1SS/11SS/SS) plus the band ``-pre_tockens <= j - i <= next_tockens``;
    - 1: ``atten_mask`` alone;
    - 2: left-up causal ``j <= i``; 3: right-down causal ``j - i <= Skv - Sq``;
    - 4: band counted from the bottom-right corner;
    - 5 / 6: right-down causal plus the first ``prefix[b]`` key columns (5 also ORs in the
      full BNSS/B1SS ``atten_mask``);
    - 7 / 8 (TND only): right-down / left-up causal, except that the last (7) / first (8)
      sequence uses the bottom-right band of ``pre_tockens``/``next_tockens``.

    Modes 2, 3, 4, 7, 8 take the compressed mask ``torch.triu(torch.ones(2048, 2048), 1).bool()``
    and mode 6 its 3072x2048 prefix variant; their shape and contents are checked, and the
    effective mask is derived from the mode and sequence lengths, never sliced from them.

    A query row left with no key (e.g. sparse_mode 3 with Sq > Skv) outputs 0, its
    softmax_max and softmax_sum are 0, and its gradients are 0. TND tokens past the last
    participating sequence also output 0.

    Not implemented: ``keep_prob < 1`` (dropout draws from the NPU's Philox stream, which a
    CPU cannot reproduce), the compressed-alibi ``pse`` and ``pse`` with TND.
    """
    fn = "npu_fusion_attention"
    if input_layout not in _LAYOUTS:
        raise ValueError(f"{fn}: input_layout={input_layout!r} is not supported; use one of {', '.join(_LAYOUTS)}")
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
    if softmax_layout not in ("", "TND") or (softmax_layout == "TND" and input_layout != "TND"):
        raise ValueError(
            f"{fn}: softmax_layout={softmax_layout!r} is not supported with input_layout={input_layout!r}; "
            "use '' (or 'TND' when input_layout='TND')"
        )
    if query.dtype not in _FLOAT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"{fn}: query/key/value dtypes ({query.dtype}, {key.dtype}, {value.dtype}) must be equal and one of "
            "float16, bfloat16, float32"
        )
    head_num = int(head_num)
    if head_num <= 0:
        raise ValueError(f"{fn}: head_num={head_num} must be positive (the query head count)")
    varlen = input_layout == "TND"
    if varlen and sparse_mode == 5:
        raise ValueError(f"{fn}: sparse_mode=5 (uncompressed prefix) is not supported with TND; use 6")
    if not varlen and sparse_mode in (7, 8):
        raise ValueError(f"{fn}: sparse_mode={sparse_mode} is only defined for input_layout='TND'")
    if not varlen and (actual_seq_qlen is not None or actual_seq_kvlen is not None):
        raise ValueError(
            f"{fn}: actual_seq_qlen/actual_seq_kvlen only apply to input_layout='TND', got {input_layout!r}"
        )
    if pse is not None and sparse_mode in (7, 8):
        raise ValueError(f"{fn}: pse is not supported with sparse_mode={sparse_mode}")

    use_mask = atten_mask is not None
    if not use_mask and sparse_mode != 0:
        warnings.warn(
            f"{fn}: sparse_mode={sparse_mode} with atten_mask=None computes full (unmasked) attention, as on "
            "the NPU; pass the compressed mask torch.triu(torch.ones(2048, 2048), diagonal=1).bool()",
            stacklevel=2,
        )
    if use_mask:
        _check_mask_dtype(atten_mask)
        if sparse_mode in (2, 3, 4, 6, 7, 8):
            _check_compressed_mask(atten_mask, sparse_mode)
        if sparse_mode in (0, 4, 7, 8) and pre_tockens + next_tockens < 0:
            raise ValueError(
                f"{fn}: pre_tockens={pre_tockens} and next_tockens={next_tockens} leave an empty band; "
                "they must satisfy pre_tockens + next_tockens >= 0"
            )
    if use_mask and sparse_mode in (5, 6):
        if prefix is None:
            raise ValueError(f"{fn}: sparse_mode={sparse_mode} needs prefix (one N per batch)")
        prefix = [int(p) for p in prefix]

    out_dtype = query.dtype
    device = query.device

    if not varlen:
        q_BNSD, k_BKSD, v_BKSD = _split_heads(query, key, value, head_num, input_layout)
        b, n, sq, _ = q_BNSD.shape
        nkv, skv = k_BKSD.shape[1], k_BKSD.shape[2]
        if n != head_num:
            raise ValueError(f"{fn}: head_num={head_num} but query has {n} heads in layout {input_layout}")
        _check_heads(fn, n, nkv, q_BNSD, k_BKSD, v_BKSD)
        masked = None
        if use_mask:
            if sparse_mode in (0, 1, 5):
                masked = _full_mask_4d(atten_mask, b, n, sq, skv, sparse_mode)
            if sparse_mode in (5, 6):
                if len(prefix) != b:
                    raise ValueError(f"{fn}: prefix has {len(prefix)} entries; it needs one per batch (B={b})")
                _check_prefix(fn, prefix, sq, skv)
                per_batch = [
                    _region_mask(sparse_mode, sq, skv, pre_tockens, next_tockens, p, True, True, device)
                    for p in prefix
                ]
                region = torch.stack(per_batch).unsqueeze(1)
            else:
                region = _region_mask(sparse_mode, sq, skv, pre_tockens, next_tockens, None, True, True, device)
                region = None if region is None else region.reshape(1, 1, sq, skv)
            if region is not None:
                masked = region if masked is None else (masked | region)
        if pse is not None:
            _check_pse(pse, b, n, sq, skv, query.dtype)
        out_BNSD, smax_BNS, ssum_BNS = _attention_core(q_BNSD, k_BKSD, v_BKSD, masked, pse, scale)
        attention_out = _merge_heads(out_BNSD.to(out_dtype), input_layout)
        softmax_max = smax_BNS.float().unsqueeze(-1).expand(b, n, sq, 8).contiguous()
        softmax_sum = ssum_BNS.float().unsqueeze(-1).expand(b, n, sq, 8).contiguous()
    else:
        attention_out, softmax_max, softmax_sum = _varlen_attention(
            fn, query, key, value, head_num, atten_mask if use_mask else None, pse, scale,
            pre_tockens, next_tockens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
        )
    softmax_out = torch.empty(0, dtype=query.dtype, device=device)
    return attention_out, softmax_max, softmax_sum, softmax_out, 0, 0, 0


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


def _check_prefix(fn: str, prefix: Sequence[int], sq: int, skv: int) -> None:
    lo = 0 if sq > skv else skv - sq
    for p in prefix:
        if not lo <= p <= skv:
            raise ValueError(f"{fn}: prefix value {p} is out of range for Sq={sq}, Skv={skv}; use [{lo}, {skv}]")


def _varlen_attention(
    fn, query, key, value, head_num, atten_mask, pse, scale, pre_tockens, next_tockens,
    prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
):
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise ValueError(
            f"{fn}: input_layout='TND' needs actual_seq_qlen and actual_seq_kvlen (cumulative end offsets)"
        )
    if pse is not None:
        raise NotImplementedError(f"{fn}: pse with input_layout='TND' (compressed alibi only) is not implemented")
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
    q_1NTD, k_1KTD, v_1KTD = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    _check_heads(fn, n, nkv, q_1NTD, k_1KTD, v_1KTD)
    q_bounds = _varlen_bounds(actual_seq_qlen, "actual_seq_qlen", t_q)
    kv_bounds = _varlen_bounds(actual_seq_kvlen, "actual_seq_kvlen", t_kv)
    if len(q_bounds) != len(kv_bounds):
        raise ValueError(
            f"{fn}: actual_seq_qlen and actual_seq_kvlen describe {len(q_bounds)} and {len(kv_bounds)} sequences; "
            "they must describe the same batches"
        )
    batch = len(q_bounds)
    if atten_mask is not None:
        if sparse_mode in (0, 1) and atten_mask.dim() != 2:
            raise ValueError(
                f"{fn}: with input_layout='TND' atten_mask must be 2-D (maxSq, maxSkv), got {tuple(atten_mask.shape)}"
            )
        if sparse_mode in (0, 1):
            max_q = max((e - s for s, e in q_bounds), default=0)
            max_kv = max((e - s for s, e in kv_bounds), default=0)
            if atten_mask.shape[0] < max_q or atten_mask.shape[1] < max_kv:
                raise ValueError(
                    f"{fn}: TND atten_mask shape {tuple(atten_mask.shape)} is smaller than (maxSq, maxSkv) = "
                    f"({max_q}, {max_kv})"
                )
        if sparse_mode == 6 and len(prefix) != batch:
            raise ValueError(f"{fn}: prefix has {len(prefix)} entries; it needs one per sequence ({batch})")

    out_dtype = query.dtype
    device = query.device
    dv = value.shape[-1]
    cdt = _compute_dtype(query.dtype)
    pieces = []
    smax_NT = torch.zeros(n, t_q, dtype=torch.float32, device=device)
    ssum_NT = torch.zeros(n, t_q, dtype=torch.float32, device=device)
    covered = 0
    for idx, ((qs, qe), (ks, ke)) in enumerate(zip(q_bounds, kv_bounds)):
        sq, skv = qe - qs, ke - ks
        if sq == 0:
            continue
        if qs != covered:
            pieces.append(query.new_zeros(qs - covered, n, dv, dtype=cdt))
        masked = None
        if atten_mask is not None:
            if sparse_mode in (0, 1):
                masked = atten_mask[:sq, :skv].bool()
            prefix_n = None
            if sparse_mode == 6:
                _check_prefix(fn, prefix[idx : idx + 1], sq, skv)
                prefix_n = prefix[idx]
            region = _region_mask(
                sparse_mode, sq, skv, pre_tockens, next_tockens, prefix_n, idx == 0, idx == batch - 1, device
            )
            if region is not None:
                masked = region if masked is None else (masked | region)
            if masked is not None:
                masked = masked.reshape(1, 1, sq, skv)
        q_1NSD = query[qs:qe].transpose(0, 1).unsqueeze(0)
        k_1KSD = key[ks:ke].transpose(0, 1).unsqueeze(0)
        v_1KSD = value[ks:ke].transpose(0, 1).unsqueeze(0)
        out_1NSD, smax_1NS, ssum_1NS = _attention_core(q_1NSD, k_1KSD, v_1KSD, masked, None, scale)
        pieces.append(out_1NSD[0].transpose(0, 1))
        smax_NT[:, qs:qe] = smax_1NS[0].float()
        ssum_NT[:, qs:qe] = ssum_1NS[0].float()
        covered = qe
    if covered < t_q:
        pieces.append(query.new_zeros(t_q - covered, n, dv, dtype=cdt))
    attention_out = torch.cat(pieces, dim=0).to(out_dtype) if pieces else query.new_zeros(t_q, n, dv)
    if softmax_layout == "TND":
        smax, ssum = smax_NT.t(), ssum_NT.t()
    else:
        # Default NTD order written into the documented (T, N, 8) buffer.
        smax, ssum = smax_NT.reshape(t_q, n), ssum_NT.reshape(t_q, n)
    softmax_max = smax.unsqueeze(-1).expand(t_q, n, 8).contiguous()
    softmax_sum = ssum.unsqueeze(-1).expand(t_q, n, 8).contiguous()
    return attention_out, softmax_max, softmax_sum


# --------------------------------------------------------------------------------------
# npu_grouped_matmul
# --------------------------------------------------------------------------------------

# output_dtype may arrive as an at::ScalarType code (the Tensor-group_list overload's schema
# types it int?), or as a torch.dtype (the List overload and the docs).
_SCALAR_TYPE_CODES = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}


def _tensor_list(fn: str, name: str, value) -> list:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{fn}: {name} must hold at least one tensor")
    return list(value)


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
) -> list:
    """Reference for ``torch_npu.npu_grouped_matmul``, non-quantized path: ``y_i = x_i @ w_i + b_i``.

    ``x``, ``weight`` and ``bias`` are lists. ``weight`` is either a list of 2-D (K, N)
    tensors or one 3-D (E, K, N) tensor (bias then one (E, N) tensor). Scenarios:

    - x single 2-D (M, K) with ``group_list``: rows split along M into one group per weight
      (``group_type=0`` with a tensor group_list; ``group_type=None`` with a list).
    - x a list matching the weights, without group_list (or with one that agrees with each
      x_i's row count): x_i @ w_i; x_i may be 2-6-D when ``split_item`` is 0/1.

    ``split_item`` 0/1 returns one tensor per group, 2/3 one tensor of the groups' rows
    concatenated. ``group_list``: tensor or list of ints; ``group_list_type`` 0 = cumulative
    end offsets, 1 = per-group counts (tensor only; a list is always cumulative, as in the
    docs). Groups may be empty. If the groups cover fewer than M rows, the uncovered tail
    rows of a single output are 0 (the docs require full coverage; the NPU leaves them
    unspecified). Accumulates in float32; output in x's dtype (``output_dtype`` may only
    restate it for non-quantized inputs). ``tuning_config`` is a performance hint, ignored.

    Quantization inputs (``scale``, ``offset``, ``antiquant_*``, ``per_token_scale``,
    ``activation_*``), int8 inputs, ``act_type != 0`` and ``group_type`` 1/2 raise
    NotImplementedError.
    """
    fn = "npu_grouped_matmul"
    for name, arg in (
        ("scale", scale),
        ("offset", offset),
        ("antiquant_scale", antiquant_scale),
        ("antiquant_offset", antiquant_offset),
        ("per_token_scale", per_token_scale),
        ("activation_input", activation_input),
        ("activation_quant_scale", activation_quant_scale),
        ("activation_quant_offset", activation_quant_offset),
    ):
        if arg is not None:
            raise NotImplementedError(
                f"{fn}: {name} (quantized / activation path) is not implemented in the reference; "
                "only the non-quantized path (x, weight, bias, group_list) is"
            )
    if act_type not in (0, None):
        raise NotImplementedError(
            f"{fn}: act_type={act_type} is only applied by the per-token quantized path; use act_type=0"
        )
    xs = _tensor_list(fn, "x", x)
    ws = _tensor_list(fn, "weight", weight)

    x_dtype = xs[0].dtype
    if x_dtype == torch.int8 or any(w.dtype in (torch.int8, torch.int32) for w in ws):
        raise NotImplementedError(f"{fn}: int8 / int4 inputs (quantized path) are not implemented in the reference")
    if x_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{fn}: x dtype {x_dtype} is not supported; use float16, bfloat16 or float32")
    if any(t.dtype != x_dtype for t in xs + ws):
        raise ValueError(f"{fn}: every x and weight tensor must have x's dtype {x_dtype} on the non-quantized path")

    if output_dtype is not None:
        out_dt = _SCALAR_TYPE_CODES.get(output_dtype) if isinstance(output_dtype, int) else output_dtype
        if out_dt != x_dtype:
            raise ValueError(
                f"{fn}: output_dtype={output_dtype} differs from x's dtype {x_dtype}; the non-quantized path "
                "outputs x's dtype (pass None)"
            )

    if split_item not in (0, 1, 2, 3):
        raise ValueError(
            f"{fn}: split_item={split_item} is not supported; use 0/1 (one output per group) or 2/3 (one output)"
        )
    single_out = split_item in (2, 3)
    if group_type in (1, 2):
        raise NotImplementedError(
            f"{fn}: group_type={group_type} ({'N' if group_type == 1 else 'K'}-axis grouping) is not implemented; "
            "use -1 (no grouping) or 0 (split along M)"
        )
    if group_type not in (None, -1, 0):
        raise ValueError(f"{fn}: group_type={group_type} is not supported; use None, -1 or 0")
    if group_list_type not in (None, 0, 1):
        raise ValueError(
            f"{fn}: group_list_type={group_list_type} is not supported; use 0 (cumulative) or 1 (counts)"
        )

    # Per-group 2-D weights; a single 3-D weight holds one (K, N) matrix per expert.
    single_3d = len(ws) == 1 and ws[0].dim() == 3
    w_list = list(ws[0].unbind(0)) if single_3d else ws
    if not single_3d and any(w.dim() != 2 for w in ws):
        raise ValueError(f"{fn}: weight must be 2-D (K, N) tensors or a single 3-D (E, K, N) tensor")
    groups = len(w_list)

    b_list = None
    if bias is not None:
        bs = _tensor_list(fn, "bias", bias)
        if single_3d:
            if len(bs) != 1 or tuple(bs[0].shape) != (groups, ws[0].shape[2]):
                raise ValueError(
                    f"{fn}: with a 3-D weight, bias must be [one tensor of shape (E, N)] = "
                    f"[({groups}, {ws[0].shape[2]})]"
                )
            b_list = list(bs[0].unbind(0))
        else:
            if len(bs) != groups or any(bi.dim() != 1 or bi.shape[0] != w.shape[1] for bi, w in zip(bs, w_list)):
                raise ValueError(f"{fn}: bias must hold one 1-D (N_i,) tensor per weight ({groups})")
            b_list = bs

    counts = None
    if group_list is not None:
        if group_type == -1:
            raise ValueError(f"{fn}: group_type=-1 (no grouping) takes group_list=None")
        if isinstance(group_list, torch.Tensor):
            if group_type is None:
                raise ValueError(f"{fn}: a tensor group_list needs group_type=0 (split along M)")
            if group_list.dim() != 1 or group_list.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"{fn}: group_list must be a 1-D int64 tensor, got {group_list.dtype} {tuple(group_list.shape)}"
                )
            values = [int(v) for v in group_list.tolist()]
            as_counts = group_list_type == 1
        else:
            if group_list_type == 1:
                raise ValueError(
                    f"{fn}: a list group_list is always cumulative end offsets (group_list_type applies to tensor "
                    "group_list only); pass cumulative offsets or a tensor with group_list_type=1"
                )
            values = [int(v) for v in group_list]
            as_counts = False
        if any(v < 0 for v in values):
            raise ValueError(f"{fn}: group_list={values} must be non-negative")
        if as_counts:
            counts = values
        else:
            if any(b < a for a, b in zip(values, values[1:])):
                raise ValueError(
                    f"{fn}: group_list={values} with group_list_type=0 must be non-decreasing cumulative offsets"
                )
            counts = [b - a for a, b in zip([0] + values[:-1], values)]
        if len(counts) != groups:
            raise ValueError(f"{fn}: group_list has {len(counts)} groups but weight has {groups}")
    if group_type == 0 and not single_out:
        raise ValueError(f"{fn}: group_type=0 returns a single tensor; use split_item=2 or 3")
    if group_type == -1 and single_out:
        raise ValueError(f"{fn}: group_type=-1 returns one tensor per group; use split_item=0 or 1")

    cdt = _compute_dtype(x_dtype)

    def mm(x_i: torch.Tensor, g: int) -> torch.Tensor:
        y = torch.matmul(x_i.to(cdt), w_list[g].to(cdt))
        if b_list is not None:
            y = y + b_list[g].to(cdt)
        return y.to(x_dtype)

    if counts is not None and len(xs) == 1:
        # One x, rows split along M into the groups.
        x_MK = xs[0]
        if x_MK.dim() != 2:
            raise ValueError(f"{fn}: a single grouped x must be 2-D (M, K), got {tuple(x_MK.shape)}")
        m = x_MK.shape[0]
        total = sum(counts)
        if total > m:
            raise ValueError(f"{fn}: group_list covers {total} rows but x has only {m}")
        if any(w.shape[0] != x_MK.shape[1] for w in w_list):
            raise ValueError(f"{fn}: weight K must equal x's last dim {x_MK.shape[1]}")
        outs, start = [], 0
        for g, c in enumerate(counts):
            outs.append(mm(x_MK[start : start + c], g))
            start += c
        if not single_out:
            return outs
        if len({w.shape[1] for w in w_list}) != 1:
            raise ValueError(f"{fn}: split_item={split_item} needs every weight to share N")
        if total < m:
            outs.append(x_MK.new_zeros(m - total, w_list[0].shape[1]))
        return [torch.cat(outs, dim=0)]

    if len(xs) != groups:
        raise ValueError(
            f"{fn}: x has {len(xs)} tensors and weight {groups} groups; pass one x per weight, or a single 2-D x "
            "with group_list"
        )
    if counts is not None and any(c != x_i.shape[0] for c, x_i in zip(counts, xs)):
        raise ValueError(
            f"{fn}: group_list sizes {counts} must equal each x's row count {[x_i.shape[0] for x_i in xs]}"
        )
    for x_i, w in zip(xs, w_list):
        if x_i.dim() < 2 or x_i.dim() > 6 or x_i.shape[-1] != w.shape[0]:
            raise ValueError(
                f"{fn}: x tensor of shape {tuple(x_i.shape)} does not match weight {tuple(w.shape)}; "
                "x must be 2-6-D (..., K) against a (K, N) weight"
            )
    outs = [mm(x_i, g) for g, x_i in enumerate(xs)]
    if not single_out:
        return outs
    if any(o.dim() != 2 for o in outs) or len({o.shape[1] for o in outs}) != 1:
        raise ValueError(f"{fn}: split_item={split_item} needs 2-D x tensors and weights sharing N")
    return [torch.cat(outs, dim=0)]


# --------------------------------------------------------------------------------------
# npu_moe_token_permute / npu_moe_token_unpermute
# --------------------------------------------------------------------------------------


def npu_moe_token_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: Optional[int] = None,
    padded_mode: bool = False,
):
    """Reference for ``torch_npu.npu_moe_token_permute``: expand tokens by top-k and sort by expert.

    ``tokens`` (num_tokens, hidden); ``indices`` (num_tokens, topK) or (num_tokens,) expert
    ids (int32/int64, >= 0). The flattened (token, k) slots are stably sorted by expert id.
    Returns ``(permuted_tokens, sorted_indices)``:

    - ``permuted_tokens``: (min(num_tokens * topK, num_out_tokens), hidden), tokens' dtype;
      ``num_out_tokens`` None or 0 keeps all rows, > 0 keeps the first rows, < 0 slices like a
      negative Python index.
    - ``sorted_indices``: int32 (num_tokens * topK,), one entry per slot:
      ``sorted_indices[i]`` is the row of permuted_tokens holding slot i, so
      ``permuted_tokens[sorted_indices[i]] == tokens[i // topK]`` (the inverse of Megatron's
      argsort). Dropped slots point at rows >= permuted_tokens.size(0).

    ``padded_mode=True`` is not supported by torch_npu (docs: "only False") and raises.
    """
    fn = "npu_moe_token_permute"
    if padded_mode:
        raise NotImplementedError(f"{fn}: padded_mode=True is not supported (torch_npu supports only False)")
    if tokens.dim() != 2:
        raise ValueError(f"{fn}: tokens must be 2-D (num_tokens, hidden_size), got {tuple(tokens.shape)}")
    if indices.dim() not in (1, 2) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: indices must be a 1-D or 2-D int32/int64 tensor, got {indices.dtype} {tuple(indices.shape)}"
        )
    if indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"{fn}: indices has {indices.shape[0]} rows but tokens has {tokens.shape[0]}")
    if indices.numel() and int(indices.min()) < 0:
        raise ValueError(f"{fn}: indices must be non-negative expert ids")
    topk = indices.shape[1] if indices.dim() == 2 else 1
    flat = indices.reshape(-1)
    total = flat.numel()
    # slot_of_row[r] = flattened (token, k) slot landing on permuted row r.
    slot_of_row = torch.argsort(flat, stable=True)
    if num_out_tokens is None or num_out_tokens == 0:
        kept = total
    else:
        kept = len(range(total)[: int(num_out_tokens)])
    permuted_tokens = tokens.index_select(0, slot_of_row[:kept] // topk)
    sorted_indices = torch.empty(total, dtype=torch.int32, device=indices.device)
    sorted_indices[slot_of_row] = torch.arange(total, dtype=torch.int32, device=indices.device)
    return permuted_tokens, sorted_indices


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[Union[Sequence[int], torch.Size]] = None,
) -> torch.Tensor:
    """Reference for ``torch_npu.npu_moe_token_unpermute``: gather, weight by probs, sum over top-k.

    ``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK + k]]`` with
    ``topK = probs.shape[-1]`` (1 without probs, and then no weighting), so the output is
    (sorted_indices.numel() // topK, hidden) in permuted_tokens' dtype. ``sorted_indices``
    is :func:`npu_moe_token_permute`'s second output. Slots pointing at rows past
    ``permuted_tokens.size(0)`` (dropped by num_out_tokens) contribute 0. Computed in float32
    for half inputs. ``padded_mode=True`` and ``restore_shape`` are not supported by
    torch_npu (docs: only False / None).
    """
    fn = "npu_moe_token_unpermute"
    if padded_mode:
        raise NotImplementedError(f"{fn}: padded_mode=True is not supported (torch_npu supports only False)")
    if restore_shape is not None:
        raise ValueError(f"{fn}: restore_shape only applies with padded_mode=True, which is unsupported; pass None")
    if permuted_tokens.dim() != 2:
        raise ValueError(f"{fn}: permuted_tokens must be 2-D, got {tuple(permuted_tokens.shape)}")
    if sorted_indices.dim() != 1 or sorted_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: sorted_indices must be a 1-D int32 tensor, "
            f"got {sorted_indices.dtype} {tuple(sorted_indices.shape)}"
        )
    total = sorted_indices.numel()
    if probs is not None:
        if probs.dim() != 2 or probs.numel() != total:
            raise ValueError(
                f"{fn}: probs must be 2-D (num_tokens, topK) with num_tokens * topK = {total} entries, "
                f"got {tuple(probs.shape)}"
            )
        topk = probs.shape[-1]
    else:
        topk = 1
    rows, hidden = permuted_tokens.shape
    cdt = _compute_dtype(permuted_tokens.dtype)
    idx = sorted_indices.long()
    if total and (int(idx.min()) < 0 or int(idx.max()) >= max(total, rows)):
        raise ValueError(f"{fn}: sorted_indices values must lie in [0, {max(total, rows) - 1}]")
    if rows == 0:
        gathered_SH = permuted_tokens.new_zeros(total, hidden, dtype=cdt)
    else:
        kept_S = idx < rows
        gathered_SH = permuted_tokens.to(cdt).index_select(0, idx.clamp(max=rows - 1))
        if not bool(kept_S.all()):
            gathered_SH = gathered_SH * kept_S.unsqueeze(-1).to(cdt)
    gathered_TKH = gathered_SH.reshape(total // topk if topk else 0, topk, hidden)
    if probs is not None:
        gathered_TKH = gathered_TKH * probs.to(cdt).unsqueeze(-1)
    return gathered_TKH.sum(dim=1).to(permuted_tokens.dtype)
