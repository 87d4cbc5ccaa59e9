"""The reference ``npu_fusion_attention`` as one dispatcher op, for selective activation checkpointing.

torch's selective checkpointing decides per dispatcher op what to save. torch_npu's
fused attention is one op (``torch.ops.npu.npu_fusion_attention``); the reference
(CPU rehearsal, simulated NPU) is a Python function of many aten ops, which the
policy would partly recompute. Registering it as ``npu_inject::reference_fusion_attention``
lets the rehearsal save it exactly as the NPU saves its kernel. Its backward
recomputes the attention inside the backward op, as the NPU's
``npu_fusion_attention_grad`` does from the saved inputs; the softmax statistics
carry no gradient (as on the NPU). A ``sink`` (gpt_oss) gets its gradient there too.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from npu_inject.ops.reference import fusion_attention as reference

FUSION_ATTENTION_OP_NAME = "npu_inject::reference_fusion_attention"
_MAX_TOCKENS = 2147483647


@torch.library.custom_op(FUSION_ATTENTION_OP_NAME, mutates_args=())
def _fusion_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, atten_mask: Optional[torch.Tensor],
    sink: Optional[torch.Tensor], head_num: int, input_layout: str, scale: float, pre_tockens: int,
    next_tockens: int, actual_seq_qlen: Optional[Sequence[int]], actual_seq_kvlen: Optional[Sequence[int]],
    sparse_mode: int, softmax_layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, softmax_max, softmax_sum, *_ = reference.npu_fusion_attention(
        query, key, value, head_num, input_layout, atten_mask=atten_mask, scale=scale,
        pre_tockens=pre_tockens, next_tockens=next_tockens, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
    )
    return out.contiguous(), softmax_max, softmax_sum


@_fusion_attention.register_fake
def _(query, key, value, atten_mask, sink, head_num, input_layout, scale, pre_tockens, next_tockens,
      actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout):
    out = query.new_empty(query.shape[:-1] + (value.shape[-1],))
    if input_layout == "TND":
        stats_shape = (query.shape[0], query.shape[1], 8)
    elif input_layout == "BSND":
        stats_shape = (query.shape[0], query.shape[2], query.shape[1], 8)
    else:  # BNSD
        stats_shape = query.shape[:3] + (8,)
    stats = query.new_empty(stats_shape, dtype=torch.float32)
    return out, stats, stats.clone()


_NON_TENSOR_ARGUMENTS = ("head_num", "input_layout", "scale", "pre_tockens", "next_tockens",
                         "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "softmax_layout")


def _setup_context(ctx, inputs, output):
    query, key, value, atten_mask, sink, *rest = inputs
    ctx.save_for_backward(query, key, value, atten_mask, sink)
    ctx.arguments = dict(zip(_NON_TENSOR_ARGUMENTS, rest))
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    query, key, value, atten_mask, sink = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(True) for t in (query, key, value)]
        sink_leaf = None if sink is None else sink.detach().requires_grad_(True)
        out, *_ = reference.npu_fusion_attention(*inputs, atten_mask=atten_mask, sink=sink_leaf, **ctx.arguments)
        grads = torch.autograd.grad(out, inputs + ([] if sink_leaf is None else [sink_leaf]), grad_out)
    grad_sink = None if sink is None else grads[3]
    return (*grads[:3], None, grad_sink, *(None for _ in _NON_TENSOR_ARGUMENTS))


_fusion_attention.register_autograd(_backward, setup_context=_setup_context)
FUSION_ATTENTION_OP = torch.ops.npu_inject.reference_fusion_attention.default


def npu_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
    scale=1.0, keep_prob=1.0, pre_tockens=_MAX_TOCKENS, next_tockens=_MAX_TOCKENS, inner_precise=0,
    prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
    sync=False, softmax_layout="", sink=None,
):
    """torch_npu's signature; the arguments npu_inject passes go through the dispatcher op.

    Anything else (pse, padding_mask, prefix, dropout) goes to the plain reference,
    which implements it or raises NotImplementedError naming it.
    """
    if pse is not None or padding_mask is not None or prefix is not None or keep_prob != 1.0:
        return reference.npu_fusion_attention(
            query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
            pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
            sparse_mode, gen_mask_parallel, sync, softmax_layout, sink,
        )
    as_list = lambda offsets: None if offsets is None else [int(x) for x in offsets]  # noqa: E731
    out, softmax_max, softmax_sum = _fusion_attention(
        query, key, value, atten_mask, sink, head_num, input_layout, float(scale), pre_tockens, next_tockens,
        as_list(actual_seq_qlen), as_list(actual_seq_kvlen), sparse_mode, softmax_layout,
    )
    return out, softmax_max, softmax_sum, torch.empty(0, dtype=query.dtype, device=query.device), 0, 0, 0


def npu_fusion_attention_v3(query, key, value, head_num, input_layout, **arguments):
    """torch_npu's v3 (TND lengths as host tensors) through the same dispatcher op."""
    return reference.fusion_attention_v3_via(npu_fusion_attention, query, key, value, head_num, input_layout,
                                             **arguments)
