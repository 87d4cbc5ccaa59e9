"""Reference ``torch_npu.npu_rms_norm`` and ``npu_rms_norm_backward``.

Docs entry ``npu_rms_norm``: ``(self, gamma, epsilon=1e-06) -> (out, rstd)`` with
``out = self * rstd * gamma`` and ``rstd = 1 / sqrt(mean(self**2 over gamma's dims) + epsilon)``;
``gamma`` covers the trailing dims of ``self`` (usually the last). The meta registration
gives ``out`` self's shape and dtype and ``rstd`` float32 with gamma's dims kept as 1.
``npu_rms_norm_backward(dy, self, gamma, rstd) -> (dx, dgamma)`` is the schema's backward
(the kernel's autograd formula); dgamma has gamma's shape and dtype.

``out`` is a fresh contiguous tensor whatever ``self``'s strides, as the NPU kernel writes
its output (and as torch's own rms_norm returns it, which torchtitan relies on: MoE's
``RoutedExperts.forward`` ``view``s the ffn_norm output). Sequence-parallel shards arrive
with a transposed layout (the embedding's Shard(1) output is (L, B, D) in memory), and
elementwise math would carry that layout into ``out``.
"""

from __future__ import annotations

import torch

from npu_inject.ops.reference._dtypes import FLOAT_DTYPES, compute_dtype


def _normalized_dims(fn: str, x: torch.Tensor, gamma: torch.Tensor) -> tuple[int, ...]:
    if x.dtype not in FLOAT_DTYPES or gamma.dtype != x.dtype:
        raise ValueError(f"{fn}: self and gamma must share a float dtype {FLOAT_DTYPES}, got {x.dtype}, {gamma.dtype}")
    if gamma.dim() == 0 or gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"{fn}: gamma {tuple(gamma.shape)} must equal the trailing dims of self {tuple(x.shape)}")
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """``(self * rstd * gamma, rstd)``; computed in float32 (rstd is float32), out in self's dtype."""
    dims = _normalized_dims("npu_rms_norm", self, gamma)
    wide = compute_dtype(self.dtype)
    x = self.to(wide)
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    out = (x * rstd * gamma.to(wide)).to(self.dtype).contiguous()
    return out, rstd.to(torch.float32) if wide == torch.float32 else rstd


def npu_rms_norm_backward(dy: torch.Tensor, self: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor):
    """Gradients of ``npu_rms_norm`` given its saved ``rstd``: ``(dx, dgamma)``.

    With ``n = x * rstd`` over the normalized dims (size M):
    ``dgamma = sum over the other dims of dy * n`` and
    ``dx = rstd * (g - n * mean(g * n))`` where ``g = dy * gamma``.
    """
    dims = _normalized_dims("npu_rms_norm_backward", self, gamma)
    wide = compute_dtype(self.dtype)
    x, dy_wide, rstd = self.to(wide), dy.to(wide), rstd.to(wide)
    normed = x * rstd
    g = dy_wide * gamma.to(wide)
    dx = rstd * (g - normed * (g * normed).mean(dim=dims, keepdim=True))
    outer_dims = tuple(range(self.dim() - gamma.dim()))
    dgamma = (dy_wide * normed).sum(dim=outer_dims) if outer_dims else dy_wide * normed
    return dx.to(self.dtype), dgamma.to(gamma.dtype)
