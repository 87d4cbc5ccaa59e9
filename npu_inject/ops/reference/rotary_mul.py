"""Reference ``torch_npu.npu_rotary_mul`` and ``npu_rotary_mul_backward``.

Docs entry ``npu_rotary_mul``: ``(input, r1, r2, rotary_mode='half', rotate=None)``,
``output = r1 * input + r2 * rotated(input)``, where ``rotated`` is

* ``'half'``: ``cat(-x2, x1)`` of the two halves of the last dim (GPT-NeoX / rotate-half);
* ``'interleave'``: each adjacent pair ``(x_even, x_odd)`` becomes ``(-x_odd, x_even)``
  (GPT-J / complex multiplication by ``r1 + i r2``).

input, r1 and r2 are 4-D; r1/r2 broadcast over input (e.g. 1S1D / BS1D for a BSND input).
``rotate`` (a user matrix, no backward) is not used by npu_inject and raises.
``npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode='half') -> (dx, dr1, dr2)``,
dr1/dr2 with r1/r2's shapes (summed over broadcast dims).
"""

from __future__ import annotations

import torch

from npu_inject.ops.reference._dtypes import FLOAT_DTYPES, compute_dtype

ROTARY_MODES = ("half", "interleave")


def _check(fn: str, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str) -> None:
    if rotary_mode not in ROTARY_MODES:
        raise ValueError(f"{fn}: rotary_mode must be one of {ROTARY_MODES}, got {rotary_mode!r}")
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise ValueError(f"{fn}: input, r1 and r2 must be 4-D, got {tuple(x.shape)}, {tuple(r1.shape)}, {tuple(r2.shape)}")
    if x.dtype not in FLOAT_DTYPES or x.shape[-1] % 2:
        raise ValueError(f"{fn}: input must be float {FLOAT_DTYPES} with an even last dim, got {x.dtype} {tuple(x.shape)}")
    if r1.shape != r2.shape or torch.broadcast_shapes(x.shape, r1.shape) != x.shape:
        raise ValueError(f"{fn}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must be equal and broadcast to input {tuple(x.shape)}")


def _rotate(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """The docs' ``x_new`` for each mode."""
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_transposed(g: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """``R^T g`` for the linear map ``R = _rotate`` (R^T = -R: both are rotations by 90 degrees)."""
    return -_rotate(g, rotary_mode)


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None):
    """``r1 * self + r2 * rotated(self)``, computed in float32, returned in self's dtype.

    The docs name the first argument ``input``; the operator's schema (what keyword calls bind) ``self``.
    """
    if rotate is not None:
        raise NotImplementedError("npu_rotary_mul: rotate (a user rotation matrix) is not used by npu_inject")
    _check("npu_rotary_mul", self, r1, r2, rotary_mode)
    wide = compute_dtype(self.dtype)
    x = self.to(wide)
    return (r1.to(wide) * x + r2.to(wide) * _rotate(x, rotary_mode)).to(self.dtype)


def npu_rotary_mul_backward(grad: torch.Tensor, self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                            rotary_mode: str = "half"):
    """``(dx, dr1, dr2)`` of ``npu_rotary_mul``: dx = r1*g + R^T(r2*g), dr1 = sum(g*x), dr2 = sum(g*R x)."""
    _check("npu_rotary_mul_backward", self, r1, r2, rotary_mode)
    wide = compute_dtype(self.dtype)
    g, x = grad.to(wide), self.to(wide)
    dx = r1.to(wide) * g + _rotate_transposed(r2.to(wide) * g, rotary_mode)
    dr1 = _sum_to(g * x, r1.shape)
    dr2 = _sum_to(g * _rotate(x, rotary_mode), r2.shape)
    return dx.to(self.dtype), dr1.to(self.dtype), dr2.to(self.dtype)
