"""muse_glimmer_masks: Muse Glimmer's per-window masks run on the fused attention kernel.

torchtitan 0.3.0's ``MuseGlimmerModel.get_attention_masks`` builds its own BlockMasks,
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
"""

from __future__ import annotations

from npu_inject.patching import PatchContext


def apply(ctx: PatchContext) -> None:
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.muse_glimmer.model import _window_mask_key

    from npu_inject.ops.attention import document_ends_from_positions, document_plan

    def get_attention_masks(original, model, positions):
        if not isinstance(model.config.first_attention.inner_attention, FlexAttention.Config):
            return original(model, positions)
        document_ends = document_ends_from_positions(positions)
        windows = {layer.attention.window_size for layer in model.config.layers} - {None}
        masks = {_window_mask_key(None): document_plan(causal=True, window=None, document_ends=document_ends)}
        for window in sorted(windows):
            masks[_window_mask_key(window)] = document_plan(causal=True, window=window, document_ends=document_ends)
        return masks

    ctx.wrap("MuseGlimmerModel.get_attention_masks", get_attention_masks)
