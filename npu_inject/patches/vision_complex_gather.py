"""Muse Glimmer's vision token permutation gathers a complex RoPE cache as real pairs: CANN's gather has no complex.

torchtitan's ``_vision_token_permute`` (``models/muse_glimmer/vision_encoder.py``) reorders each
image's patch tokens with ``torch.gather`` along the token axis, for the hidden states and for the
complex64 RoPE cache alike. torch_npu 2.14.0 passes the complex64 cache to ``aclnnGather``, whose
document (hicann/ops-nn ``index/gather_elements_v2/docs/aclnnGather.md``) lists no complex dtype
on any product: the first step stops with 161002 (what the CANN emulation reports). This patch
permutes a complex tensor through its ``view_as_real`` (the same gather over (real, imaginary)
pairs, a trailing axis of 2) and views the result as complex again, on every target, so the
rehearsal computes what the NPU does; a real tensor goes through unchanged. Both views are free
and differentiable, so the gradient is the same scatter over real pairs.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.muse_glimmer.vision_encoder:_vision_token_permute",
)


def apply(ctx: PatchContext) -> None:
    import torch

    def vision_token_permute(original, x, index):
        if not x.is_complex():
            return original(x, index)
        return torch.view_as_complex(original(torch.view_as_real(x), index))

    ctx.wrap("_vision_token_permute", vision_token_permute)
