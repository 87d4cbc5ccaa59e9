"""Reference ``torch_npu.npu_moe_token_permute`` / ``npu_moe_token_unpermute``.

:mod:`npu_inject.ops.moe` permutes with 2-D (token, top-k) or 1-D expert ids and
unpermutes with or without probs; the reference implements every documented
argument except ``padded_mode=True`` and ``restore_shape``, which torch_npu itself
does not support. ``num_out_tokens`` (dropping the last permuted rows), which nothing
here passes, is tested against hand-computed rows (tests/unit/ops/test_moe_token_permute.py).
The second registration of each op in torch_npu's docs is the one followed
(``verification/torch_npu_docs.md`` says why).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from npu_inject.ops.reference._dtypes import compute_dtype


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
    cdt = compute_dtype(permuted_tokens.dtype)
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
