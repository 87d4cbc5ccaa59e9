"""Muse Glimmer's per-window causal masks and its vision encoder's per-image mask run on npu_fusion_attention.

torchtitan's ``MuseGlimmerModel.get_attention_masks`` builds its own BlockMasks,
not through ``Decoder._create_flex_attention_mask``: a dict keyed ``"global"`` and
``"swa_<n>"``, each the causal AND packed-document mask mods, AND a sliding window
of n tokens for the windowed layers. The attention patch never saw those mask mods,
so every layer ran on its reference fallback (explicit dense masks).

Those masks are exactly what the kernel expresses (TND per document; band sparse
mode for a window), so this patch returns the same dict with an
:class:`~npu_inject.ops.attention.AttentionPlan` per key, which the attention
patch's ``FlexAttention.forward`` runs on ``npu_fusion_attention`` (torch_npu on
the NPU, the reference kernel in the rehearsal). The document ends are read from
``positions`` once per forward, shared by every key. Varlen configs keep upstream's
path (the attention patch already handles VarlenAttention).

Its vision encoder (``muse_glimmer_mm``) masks each image to its own patches through
a torch.compile'd ``create_block_mask``, even without ``--compile.enable``. That mask
mod is answered, as qwen3_5_masks does, with a bidirectional AttentionPlan (one
document per image's patches and one per row's padding, whose outputs are never
read). Its windowed mask (``sparse_attention_factor`` > 1) is built by eager
``create_block_mask`` -- the same BlockMask, run on the attention patch's reference
fallback: compiling it fails on both targets (torch 2.14.1's CPU inductor emits
invalid C++ for a batch-indexed mask shorter than a block; inductor has no backend
for the simulated npu). That choice is a reported fallback.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.muse_glimmer.model:MuseGlimmerModel.get_attention_masks",
    "torchtitan.models.muse_glimmer.vision_encoder:compiled_create_block_mask",
)


def apply(ctx: PatchContext) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.vision_encoder import get_vision_block_mask_mod
    from torchtitan.models.muse_glimmer.model import _window_mask_key

    from npu_inject.ops import attention as attention_ops
    from npu_inject.ops.attention import document_plan, vision_plan

    vision_mask_code = get_vision_block_mask_mod(torch.ones(1, dtype=torch.long)).__code__

    def get_attention_masks(original, model, positions):
        if not isinstance(model.config.first_attention.inner_attention, FlexAttention.Config):
            return original(model, positions)
        document_ends = attention_ops.document_ends_from_positions(positions)
        windows = {layer.attention.window_size for layer in model.config.layers} - {None}
        masks = {_window_mask_key(None): document_plan(causal=True, window=None, document_ends=document_ends)}
        for window in sorted(windows):
            masks[_window_mask_key(window)] = document_plan(causal=True, window=window, document_ends=document_ends)
        return masks

    def vision_block_mask(original, mask_mod, B, H, Q_LEN, KV_LEN, *args, **kwargs):
        plan = vision_plan(mask_mod, vision_mask_code, B, Q_LEN, KV_LEN, "muse_glimmer")
        if plan is not None:
            return plan
        ctx.fallback("muse_glimmer vision encoder: a mask other than per-image (the windowed one) is built by "
                     "eager create_block_mask and runs on reference attention (its compiled build fails on the "
                     "CPU and has no inductor backend on the simulated npu)")
        return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, *args, **kwargs)

    ctx.wrap("MuseGlimmerModel.get_attention_masks", get_attention_masks)
    ctx.wrap("compiled_create_block_mask", vision_block_mask)
