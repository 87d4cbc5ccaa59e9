"""Flex and varlen attention on npu_fusion_attention (BSND/TND, causal/band modes, GQA); reference math otherwise.

torchtitan language models accept only FlexAttention (no NPU kernel, no
CPU backward) and VarlenAttention (CUDA flash attention). This patch:

* replaces ``Decoder._create_flex_attention_mask``: when the mask mods are ones
  the kernel can express -- causal, packed-document causal, sliding window --
  it returns an :class:`AttentionPlan` (no BlockMask is built); any other mask
  still gets upstream's BlockMask;
* replaces ``FlexAttention.forward``: an AttentionPlan runs through
  ``npu_fusion_attention`` (BSND causal, TND per document, band for windows);
  a BlockMask or a score_mod falls back to explicit reference math, with a
  one-time warning and a report entry;
* replaces ``VarlenAttention.forward``: TND with the cumulative lengths from
  torchtitan's VarlenMetadata; ``window_size`` maps to causal, band or full.

An ``out_transform`` needs a differentiable log-sum-exp, which the kernel does not return,
and runs on reference math -- except gpt_oss's ``Attention._apply_sinks`` (``out *
sigmoid(lse - sinks)``), which is what the kernel's ``sink`` argument computes: those
layers pass their sinks to the kernel.

Packed documents reach the kernel (``npu_fusion_attention_v3``) as a CPU int64
tensor of document ends, never as host ints inside a compiled block: dynamo
would specialize on every offset and recompile each batch. In eager the ends come
from the metadata's host offsets, which ``Decoder.forward`` fills in once per forward
(one device-to-host copy, outside the checkpointed blocks) when torchtitan made the
metadata without them. Each layer then does the same ops whatever ran before it:
selective activation checkpointing replays a block's ops by count, and a pipeline
schedule runs the next microbatch's forward before this one's backward, so a
"first layer reads, the others reuse" cache made recomputes read where forwards had not.

The causal and band modes (sparse_mode 2/3/4) take the kernel's compressed 2048x2048 mask,
built once per device and cached, whatever the sequence length.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import create_mask

from npu_inject.ops import spmd_typing
from npu_inject.ops.attention import (
    AttentionPlan,
    document_ends_from_positions,
    document_plan,
    fusion_attention_BLNH,
    plan_keep_mask,
    reference_attention_BLNH,
)
from npu_inject.ops.cp import (
    ContextParallelPlan,
    context_parallel_attention_BLNH,
    context_parallel_reference_attention_BLNH,
)
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.decoder:Decoder.forward",
    "torchtitan.models.common.decoder:Decoder._create_flex_attention_mask",
    "torchtitan.models.common.attention:FlexAttention.forward",
    "torchtitan.models.common.attention:VarlenAttention.forward",
)


def apply(ctx: PatchContext) -> None:
    mask_mod_codes = _mask_mod_codes()
    ctx.wrap("Decoder.forward", decoder_forward)
    ctx.wrap("Decoder._create_flex_attention_mask", functools.partial(create_flex_attention_mask, mask_mod_codes))
    ctx.wrap("FlexAttention.forward", functools.partial(flex_forward, ctx))
    ctx.wrap("VarlenAttention.forward", functools.partial(varlen_forward, ctx))


# -- Decoder.forward: host document ends once per forward ----------------------------------------

def decoder_forward(original, decoder, tokens, positions=None, attention_masks=None):
    if attention_masks is not None and not torch.compiler.is_compiling():
        attention_masks = with_host_offsets(attention_masks)
    return original(decoder, tokens, positions=positions, attention_masks=attention_masks)


def with_host_offsets(attention_masks):
    """``attention_masks`` with every VarlenMetadata carrying its host offsets, as torchtitan's
    ``create_varlen_metadata_for_document(..., include_host_offsets=True)`` makes them."""
    from torchtitan.models.common.attention import VarlenMetadata

    def filled(metadata):
        if not isinstance(metadata, VarlenMetadata) or metadata.cu_seq_q_host is not None:
            return metadata
        with spmd_typing.opaque_kernel():  # host metadata, unchecked as in upstream's own tolist()
            return metadata._replace(cu_seq_q_host=tuple(int(end) for end in metadata.cu_seq_q.tolist()))

    if isinstance(attention_masks, dict):
        return {key: filled(value) for key, value in attention_masks.items()}
    return filled(attention_masks)


# -- Decoder._create_flex_attention_mask: an AttentionPlan where the kernel expresses the mask ------

def _mask_mod_codes():
    """Code objects of torchtitan's mask-mod closures, to recognise them without calling them."""
    from torchtitan.models.common import attention

    one_row, two_rows = torch.zeros(1, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)
    return {
        attention.get_causal_mask_mod().__code__: "causal",
        attention.get_document_mask_mod(one_row).__code__: "document",
        attention.get_efficient_causal_mask_mod_for_packed_document(one_row).__code__: "document",
        attention.get_efficient_causal_mask_mod_for_packed_document(two_rows).__code__: "document",
        attention.get_sliding_window_mask_mod(1).__code__: "window",
    }


def create_flex_attention_mask(mask_mod_codes, original, decoder, positions, attn_config, mask_mods):
    plan = plan_for_mask_mods(mask_mods, positions, mask_mod_codes)
    return plan if plan is not None else original(decoder, positions, attn_config, mask_mods)


def plan_for_mask_mods(mask_mods, positions_BL, codes):
    """An AttentionPlan for ANDed mask mods, or None when the kernel cannot express them."""
    kinds, window = set(), None
    for mask_mod in mask_mods:
        kind = codes.get(getattr(mask_mod, "__code__", None))
        if kind is None:
            return None
        if kind == "window":
            cells = dict(zip(mask_mod.__code__.co_freevars, mask_mod.__closure__ or ()))
            window = cells["window_size"].cell_contents
        kinds.add(kind)
    if "causal" not in kinds and "window" not in kinds:
        return None  # a document mask without causality is not one of the kernel's modes
    if "document" in kinds:
        return document_plan(causal=True, window=window, document_ends=document_ends_from_positions(positions_BL))
    return AttentionPlan(causal=True, window=window)


# -- FlexAttention.forward: a plan on the kernel, anything else on reference math -----------------

def flex_forward(ctx, original, flex, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None,
                 scale=None, enable_gqa=False, out_transform=None, **kwargs):
    # enable_gqa needs no flag: the kernel takes fewer key/value heads than query heads.
    mask = attention_masks
    if isinstance(mask, ContextParallelPlan):
        _check_no_cp_extras(score_mod, None)
        if out_transform is None:
            return context_parallel_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, mask, mask.plan, scale)
        ctx.fallback("FlexAttention with an out_transform under context parallel runs on reference "
                     "attention over all-gathered key/value (needs a differentiable log-sum-exp)")
        out_BlNH, lse_BlN = context_parallel_reference_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, mask,
                                                                       mask.plan, scale)
        return out_transform(out_BlNH, lse_BlN)
    sinks_N = gpt_oss_sinks(out_transform)
    if isinstance(mask, AttentionPlan) and score_mod is None and (out_transform is None or sinks_N is not None):
        out_BLNH, _ = fusion_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, mask, scale, sink_N=sinks_N)
        return out_BLNH
    if score_mod is not None:
        what = "a score_mod"
    elif out_transform is not None:
        what = "an out_transform (needs a differentiable log-sum-exp, which the kernel does not return)"
    else:
        what = "a mask the fused kernel cannot express"
    ctx.fallback(f"FlexAttention with {what} runs on reference attention (explicit mask, slower)")
    out_BLNH, lse_BLN = typed_reference_attention(
        q_BLNH, k_BLNH, v_BLNH, lambda: _dense_keep_mask(mask, q_BLNH, k_BLNH), scale, score_mod)
    return out_BLNH if out_transform is None else out_transform(out_BLNH, lse_BLN)


def typed_reference_attention(q_BLNH, k_BLNH, v_BLNH, keep_mask, scale, score_mod=None):
    # In place of upstream's flex_attention kernel: the same typing boundary (spmd_types type
    # checking), the mask built from host document ends inside it.
    with spmd_typing.opaque_kernel():
        out_BLNH, lse_BLN = reference_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, keep_mask(), scale, score_mod)
    return spmd_typing.type_like(out_BLNH, q_BLNH), spmd_typing.type_like(lse_BLN, q_BLNH, keep_dims=3)


def _check_no_cp_extras(score_mod, out_transform):
    if score_mod is not None or out_transform is not None:
        raise NotImplementedError("context parallel (patch context_parallel) runs the fused kernel only: "
                                  "a score_mod (or varlen's out_transform) needs context_parallel_degree 1")


def _dense_keep_mask(mask, q_BLNH, k_BLNH):
    B, L, S = q_BLNH.shape[0], q_BLNH.shape[1], k_BLNH.shape[1]
    if not isinstance(mask, AttentionPlan):
        return create_mask(mask.mask_mod, B, None, L, S, device=q_BLNH.device)
    return plan_keep_mask(mask, B, L, S, q_BLNH.device)


# -- VarlenAttention.forward: TND on the kernel ---------------------------------------------------

def varlen_forward(ctx, original, varlen, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None,
                   out_transform=None, **kwargs):
    metadata = attention_masks
    left, right = varlen.window_size
    if (left, right) == (-1, -1):
        causal, window = False, None
    elif right == 0:
        causal, window = True, None if left < 0 else left + 1
    else:
        raise NotImplementedError(
            f"VarlenAttention window_size={varlen.window_size}: the NPU kernel's band mode "
            "needs right == 0 (causal or sliding window) or (-1, -1) (full)"
        )
    if isinstance(metadata, ContextParallelPlan):
        _check_no_cp_extras(None, out_transform)
        # Context parallel cuts documents into per-rank segments on the host: it keeps host offsets.
        plan = AttentionPlan(causal=causal, window=window, document_ends=metadata.cu_seq_q_host[1:])
        return context_parallel_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, metadata, plan, scale)
    plan = AttentionPlan(causal=causal, window=window, document_ends_tensor=host_document_ends(metadata))
    sinks_N = gpt_oss_sinks(out_transform)
    if out_transform is not None and sinks_N is None:
        ctx.fallback("VarlenAttention with an out_transform runs on reference attention "
                     "(needs a differentiable log-sum-exp, which the kernel does not return)")
        B, L = q_BLNH.shape[:2]
        out_BLNH, lse_BLN = typed_reference_attention(
            q_BLNH, k_BLNH, v_BLNH, lambda: plan_keep_mask(plan, B, L, L, q_BLNH.device), scale)
        return out_transform(out_BLNH, lse_BLN)
    out_BLNH, _ = fusion_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, plan, scale, sink_N=sinks_N)
    return out_BLNH


def gpt_oss_sinks(out_transform):
    """gpt_oss's per-head sinks when ``out_transform`` is its ``Attention._apply_sinks``, else None.

    Recognised by the function itself (the bound method of torchtitan's class, from the module
    already imported), never by calling it; its sinks are taken as it takes them. Plain attribute
    reads: torch.compile does not see a bound method's ``__func__`` through ``getattr`` with a default.
    """
    model = sys.modules.get("torchtitan.models.gpt_oss.model")
    if model is None or not isinstance(out_transform, types.MethodType) \
            or out_transform.__func__ is not model.Attention._apply_sinks:
        return None
    sinks_N = out_transform.__self__.sinks
    if isinstance(sinks_N, DTensor):  # as upstream: this rank's heads, gradients kept in the sinks' placement
        sinks_N = sinks_N.to_local(grad_placements=sinks_N.placements)
    return sinks_N


def host_document_ends(metadata):
    """The document ends as the CPU int64 tensor torch_npu reads: from torchtitan's host offsets
    when the metadata has them, else a device-to-host copy of cu_seq_q (on an NPU)."""
    with spmd_typing.opaque_kernel():  # kernel metadata, unchecked as in upstream's varlen_attn call
        host = metadata.cu_seq_q_host
        if host is not None and not torch.compiler.is_compiling():
            # Host offsets would be ints a compiled block specializes on: it copies its own below.
            return torch.tensor(host[1:], dtype=torch.int64)
        # Compiled, or metadata that did not pass Decoder.forward (a model with its own forward):
        # a device-to-host copy per layer.
        return metadata.cu_seq_q[1:].to(device="cpu", dtype=torch.int64)
