"""qwen3_5's masks run on npu_fusion_attention: causal packed documents (TND) and its vision encoder's per-image mask.

Targets torchtitan's ``torchtitan.models.qwen3_5`` (flex configs such as
``qwen35_debugmodel``); requires the attention patch, which runs an
:class:`~npu_inject.ops.attention.AttentionPlan` on ``npu_fusion_attention``, and
gated_delta_net (qwen3_5's model module imports only while its fla stand-in serves).

* ``Qwen35Model.get_attention_masks`` builds its full-attention layers' mask
  through ``Decoder.get_attention_masks`` and then asserts it is a BlockMask. The
  attention patch answers that call with an AttentionPlan (causal + packed
  documents: TND per document), so the assert stopped every flex run. This patch
  returns upstream's dict -- ``"quadratic_attention"`` and the gated delta-net's
  ``"deltanet"`` varlen metadata -- without the assert: the plan when the kernel
  expresses the mask, else upstream's BlockMask, which the attention patch runs on
  its reported reference fallback. Varlen configs keep upstream's path.
* The vision encoder masks each image to its own patches in a padded batch
  (``get_vision_block_mask_mod``: query and key both below the image's patch count)
  through a torch.compile'd ``create_block_mask``. This patch answers that mask mod
  with a bidirectional AttentionPlan (TND, one document per image's patches and one
  per row's padding), so the encoder runs on the kernel and compiles no mask.
  Padding rows then attend to padding instead of nothing (flex gives them 0); their
  outputs are never read (``scatter_vision_embeds`` takes each image's real tokens
  only) and they share no document with a real patch, so real outputs and all
  gradients are unchanged. Any other mask mod gets upstream's BlockMask.

Revert restores both functions (PatchContext).
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.qwen3_5.model:Qwen35Model.get_attention_masks",
    "torchtitan.models.qwen3_5.vision_encoder:compiled_create_block_mask",
)


def apply(ctx: PatchContext) -> None:
    import importlib

    import torch
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.common.vision_encoder import get_vision_block_mask_mod

    from npu_inject.ops.attention import vision_plan

    model_module = importlib.import_module("torchtitan.models.qwen3_5.model")
    vision_mask_code = get_vision_block_mask_mod(torch.ones(1, dtype=torch.long)).__code__

    def get_attention_masks(original, model, positions):
        attn_config = model.config.first_attention
        if attn_config is None or not isinstance(attn_config.inner_attention, FlexAttention.Config):
            return original(model, positions)
        return {
            # An AttentionPlan (fused kernel) or, for a mask the kernel cannot express,
            # upstream's BlockMask on the attention patch's reported fallback.
            "quadratic_attention": Decoder.get_attention_masks(model, positions),
            "deltanet": model_module.create_varlen_metadata_for_document(positions, include_host_offsets=True),
        }

    def create_block_mask(original, mask_mod, B, H, Q_LEN, KV_LEN, *args, **kwargs):
        plan = vision_plan(mask_mod, vision_mask_code, B, Q_LEN, KV_LEN, "qwen3_5")
        return plan if plan is not None else original(mask_mod, B, H, Q_LEN, KV_LEN, *args, **kwargs)

    ctx.wrap("Qwen35Model.get_attention_masks", get_attention_masks)
    ctx.wrap("compiled_create_block_mask", create_block_mask)
