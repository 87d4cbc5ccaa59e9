"""Reference ``torch_npu.npu_swiglu`` and ``npu_swiglu_backward``.

Docs entry ``npu_swiglu``: ``(self, dim=-1) -> Tensor``; ``self`` is split in two halves
A, B along ``dim`` and the output is ``swish(A) * B = A * sigmoid(A) * B`` (half the size
along ``dim``), fp32/fp16/bf16, 1-8 dims. ``npu_swiglu_backward(grad_output, self, dim=-1)``
returns the gradient with respect to ``self`` (the schema's backward).
"""

from __future__ import annotations

import torch

from npu_inject.ops.reference._dtypes import FLOAT_DTYPES, compute_dtype


def _halves(fn: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in FLOAT_DTYPES or not 1 <= x.dim() <= 8:
        raise ValueError(f"{fn}: self must be a 1-8-D float tensor {FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if x.shape[dim] % 2:
        raise ValueError(f"{fn}: self's size along dim={dim} must be even, got {tuple(x.shape)}")
    wide = x.to(compute_dtype(x.dtype))
    return wide.chunk(2, dim=dim)


def npu_swiglu(self: torch.Tensor, dim: int = -1):
    """``A * sigmoid(A) * B`` for the halves A, B of self along dim, in self's dtype."""
    a, b = _halves("npu_swiglu", self, dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


def npu_swiglu_backward(grad_output: torch.Tensor, self: torch.Tensor, dim: int = -1):
    """d self = cat(g * B * sig(A) * (1 + A * (1 - sig(A))), g * A * sig(A)) along dim."""
    a, b = _halves("npu_swiglu_backward", self, dim)
    g = grad_output.to(a.dtype)
    sig = torch.sigmoid(a)
    da = g * b * sig * (1 + a * (1 - sig))
    db = g * a * sig
    return torch.cat((da, db), dim=dim).to(self.dtype)
