"""Muse Glimmer's vision position embedding resamples in float32: CANN's grid sampler takes no bfloat16 on A2/A3.

torchtitan's ``_vision_pos_embed`` (``models/muse_glimmer/vision_encoder.py``) resizes the
learned position table to each image's patch grid with ``F.grid_sample`` in the table's
dtype. Under bf16 parameters torch_npu 2.14.0 passes bfloat16 to ``aclnnGridSampler2D``,
whose document (hicann/ops-cv ``image/grid_sample/docs/aclnnGridSampler2D.md``) lists
BFLOAT16 but excludes it on Atlas A2 and A3: the first step stops with 161002 (what the CANN
emulation reports). This patch runs upstream's function on a float32 copy of the table and
casts the result back, on every target, so the rehearsal computes what the NPU does; a
float32 or float16 table goes through unchanged. The gradient flows through both casts.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.muse_glimmer.vision_encoder:_vision_pos_embed",
)


def apply(ctx: PatchContext) -> None:
    import torch

    def vision_pos_embed(original, pos_param, **kwargs):
        if pos_param.dtype != torch.bfloat16:
            return original(pos_param, **kwargs)
        return original(pos_param.float(), **kwargs).to(torch.bfloat16)

    ctx.wrap("_vision_pos_embed", vision_pos_embed)
