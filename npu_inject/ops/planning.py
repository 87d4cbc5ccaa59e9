"""The kernels under a FakeTensorMode (``npu-inject plan``): what they allocate and keep, nothing computed.

Under fake tensors a kernel's value does not matter, only what the NPU's kernel would allocate, keep
for backward and cost. The kernels with a custom op (:mod:`npu_inject.ops.rehearsal`: fusion
attention, grouped matmul, MoE permute/unpermute) are those ops, whose fakes give torch_npu's output
shapes. The elementwise block kernels -- ``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu`` and
their backward kernels -- are autograd functions here that allocate torch_npu's outputs and save what
its autograd formulas save (torch_npu 2.14.0's ``npu_*_backward`` schemas: rms_norm saves x, gamma
and rstd; rotary_mul x, r1 and r2; swiglu its input); the reference kernels would instead keep their
float32 intermediates for autograd. Each call is announced to the planner's hook
(:data:`npu_inject.ops.planner_hooks.announce`, its recorder), which counts it as one kernel launch with
the bytes it reads and writes.
"""

from __future__ import annotations

from typing import Any

import torch

from npu_inject.ops import planner_hooks, rehearsal


def _announce(name: str, inputs: tuple, outputs: tuple) -> None:
    if planner_hooks.announce is not None:
        planner_hooks.announce(name, inputs, outputs)


def _like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_like(tensor, dtype=dtype, memory_format=torch.contiguous_format)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, epsilon):
        reduced = x.narrow(-1, 0, 1) if gamma.dim() == 1 else x.flatten(-gamma.dim()).narrow(-1, 0, 1)
        rstd = _like(reduced, torch.float32)
        out = _like(x)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        _announce("npu_rms_norm", (x, gamma), (out, rstd))
        return out, rstd

    @staticmethod
    def backward(ctx, grad_out, grad_rstd):
        x, gamma, rstd = ctx.saved_tensors
        grads = (_like(x), _like(gamma))
        _announce("npu_rms_norm_backward", (grad_out, x, gamma, rstd), grads)
        return (*grads, None)


class _RotaryMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r1, r2, rotary_mode):
        out = _like(x)
        ctx.save_for_backward(x, r1, r2)
        _announce("npu_rotary_mul", (x, r1, r2), (out,))
        return out

    @staticmethod
    def backward(ctx, grad):
        x, r1, r2 = ctx.saved_tensors
        grads = (_like(x), _like(r1) if ctx.needs_input_grad[1] else None,
                 _like(r2) if ctx.needs_input_grad[2] else None)
        _announce("npu_rotary_mul_backward", (grad, x, r1, r2), tuple(g for g in grads if g is not None))
        return (*grads, None)


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        out = _like(x.narrow(dim, 0, x.shape[dim] // 2))
        ctx.save_for_backward(x)
        ctx.dim = dim
        _announce("npu_swiglu", (x,), (out,))
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return npu_swiglu_backward(grad, x, ctx.dim), None


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    return _RmsNorm.apply(self, gamma, epsilon)


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None):
    return _RotaryMul.apply(self, r1, r2, rotary_mode)


def npu_swiglu(self: torch.Tensor, dim: int = -1):
    return _Swiglu.apply(self, dim)


def npu_swiglu_backward(grad_output: torch.Tensor, self: torch.Tensor, dim: int = -1):
    grad = _like(self)
    _announce("npu_swiglu_backward", (grad_output, self), (grad,))
    return grad


def __getattr__(name: str) -> Any:
    # The kernels with a custom op, and whatever else the ops layer asks for: the rehearsal's.
    return getattr(rehearsal, name)
