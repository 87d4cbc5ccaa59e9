"""RoPE as one npu_rotary_mul per q and k, with no complex tensor on the device.

torchtitan has two RoPE formats (``models/common/rope.py``):

* ``ComplexRoPE`` (llama3, deepseek_v3's MLA rope dims) keeps a complex64 ``cis`` cache
  and rotates adjacent pairs with ``view_as_complex`` -- complex tensors, which Ascend
  handles poorly. The patch builds the cache on the host as upstream does and keeps only
  its real ``[cos | sin]`` (each repeated per pair, width 2H) on the device; rotation is
  ``npu_rotary_mul(x, cos, sin, 'interleave')``. A complex cache built elsewhere and passed to
  ``apply_rotary_emb`` (muse_glimmer's vision encoder) is made real the same way first.
* ``CosSinRoPE`` (qwen3) keeps ``[cos | sin]`` in rotate-half layout; rotation is
  ``npu_rotary_mul(x, cos, sin, 'half')``.

The cache is a non-persistent buffer (never in a checkpoint), and upstream's cache
slicing/gathering by position works on the real cache unchanged. Each q and k is one
kernel call. Glue: :mod:`npu_inject.ops.rotary`.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.rope:ComplexRoPE._precompute_cache",
    "torchtitan.models.common.rope:ComplexRoPE.apply_rotary_emb",
    "torchtitan.models.common.rope:CosSinRoPE.apply_rotary_emb",
)


def apply(ctx: PatchContext) -> None:
    import torch

    from npu_inject.ops import rotary

    def complex_cache(original, rope):
        # Upstream's frequencies (llama/yarn scaling included), computed on the host:
        # torch.polar makes a complex tensor, which must not reach the device.
        device = torch.get_default_device()
        with torch.device("cpu"):
            cis_SP = original(rope)
        return rotary.interleaved_cos_sin_cache(cis_SP).to(device)

    def complex_apply(original, query, key, rope_cache):
        if rope_cache.is_complex():
            # A cache built outside _precompute_cache (muse_glimmer's vision encoder makes its own 2D
            # one per forward, (N, P, 1, H/2)): the same cos/sin, made real before the kernel.
            rope_cache = rotary.interleaved_cos_sin_cache(rope_cache)
        return rotary.rotate_pairs(query, rope_cache), rotary.rotate_pairs(key, rope_cache)

    def cos_sin_apply(original, query, key, rope_cache):
        return rotary.rotate_half(query, rope_cache), rotary.rotate_half(key, rope_cache)

    ctx.wrap("ComplexRoPE._precompute_cache", complex_cache)
    ctx.wrap("ComplexRoPE.apply_rotary_emb", complex_apply)
    ctx.wrap("CosSinRoPE.apply_rotary_emb", cos_sin_apply)
