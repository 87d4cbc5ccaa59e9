"""torchtitan's two RoPE formats as ``npu_rotary_mul`` calls on real cos/sin caches.

Shapes follow torchtitan's ``models/common/rope.py``: q/k are ``(B, L, N, H)`` (BSND),
the prepared cache broadcasts as ``(1 or B, L, 1, width)``.

* ``CosSinRoPE`` already keeps ``[cos | sin]`` of width ``2H`` in rotate-half layout:
  ``npu_rotary_mul(x, cos, sin, 'half')`` is its formula.
* ``ComplexRoPE`` multiplies adjacent pairs ``(x_2i, x_2i+1)`` by ``cis(angle_i)``. With
  ``cos``/``sin`` of each angle repeated for both members of the pair, that is
  ``npu_rotary_mul(x, cos, sin, 'interleave')``. Its cache becomes the real
  ``[cos_pairs | sin_pairs]`` of width ``2H`` (:func:`interleaved_cos_sin_cache`), so no
  complex tensor reaches the device. The cache is a non-persistent buffer: checkpoints
  never held it.

torch_npu documents ``interleave`` only for a cache without a batch dim (1S1D for BSND);
with per-sample positions (BS1D) the pairs are de-interleaved into halves, rotated in
``half`` mode and interleaved back (:func:`rotate_pairs`).
"""

from __future__ import annotations

import torch

from npu_inject.ops import kernels


def interleaved_cos_sin_cache(complex_cache_SP: torch.Tensor) -> torch.Tensor:
    """``(S, H/2)`` complex ``cis`` values -> real ``(S, 2H)``: cos, sin each repeated per pair."""
    cos_SP, sin_SP = complex_cache_SP.real, complex_cache_SP.imag
    return torch.cat([cos_SP.repeat_interleave(2, dim=-1), sin_SP.repeat_interleave(2, dim=-1)], dim=-1)


def _cos_sin(x_BLNH: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = x_BLNH.shape[-1]
    if rope_cache.shape[-1] != 2 * head_dim:
        raise ValueError(
            f"npu_inject rotary: the prepared RoPE cache {tuple(rope_cache.shape)} must hold cos and sin of "
            f"the head dim {head_dim} (last dim {2 * head_dim})"
        )
    # The kernel takes one dtype; upstream rotates in float32 and casts back, the kernel
    # computes internally in float32 as well.
    return rope_cache[..., :head_dim].to(x_BLNH.dtype), rope_cache[..., head_dim:].to(x_BLNH.dtype)


def rotate_half(x_BLNH: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """CosSinRoPE's ``x*cos + rotate_half(x)*sin`` through npu_rotary_mul('half')."""
    cos, sin = _cos_sin(x_BLNH, rope_cache)
    return kernels().npu_rotary_mul(x_BLNH, cos, sin, rotary_mode="half")


def rotate_pairs(x_BLNH: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """ComplexRoPE's pairwise complex rotation through npu_rotary_mul('interleave')."""
    cos, sin = _cos_sin(x_BLNH, rope_cache)
    if cos.shape[0] == 1:
        return kernels().npu_rotary_mul(x_BLNH, cos, sin, rotary_mode="interleave")
    # BS1D cache: 'interleave' is documented for 1S1D only; rotate the de-interleaved halves.
    halves = torch.cat([x_BLNH[..., ::2], x_BLNH[..., 1::2]], dim=-1)
    cos_half = torch.cat([cos[..., ::2], cos[..., ::2]], dim=-1)
    sin_half = torch.cat([sin[..., ::2], sin[..., ::2]], dim=-1)
    rotated = kernels().npu_rotary_mul(halves, cos_half, sin_half, rotary_mode="half")
    first, second = rotated.chunk(2, dim=-1)
    return torch.stack([first, second], dim=-1).flatten(-2)
