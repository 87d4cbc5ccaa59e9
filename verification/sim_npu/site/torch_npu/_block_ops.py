"""torch_npu's transformer-block kernels as operators, with autograd and DTensor strategies.

On a real NPU ``torch_npu.npu_rms_norm``, ``npu_rotary_mul`` and ``npu_swiglu`` are
operators (``torch.ops.npu.*``) whose autograd formulas call the ``*_backward``
operators, and ``torch_npu/distributed/tensor/_math_ops.py`` registers DTensor sharding
strategies for all six, so the fused ops run under tensor parallel. The stand-in does
the same: the six are custom ops in the ``npu`` namespace with torch_npu 2.14.0's
schemas (``csrc/aten/npu_native_functions_by_codegen.yaml``), computed by the
project's reference kernels (``npu_inject.ops.reference``, imported on first call),
with fake implementations for shape propagation and strategies written from what the
kernels compute:

* rms_norm: any dim before the normalized ones may be sharded (rstd follows it); gamma
  is replicated; its gradient is a partial sum over the shards.
* rotary_mul: any dim but the last (head) dim; r1/r2 are sharded with x where they
  have that dim, replicated where they broadcast (their gradients are then partial).
* swiglu: any dim but the one split into gate and up.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding


def _sibling(name: str):
    """A module of this directory, loaded by path: this file is also loaded on its own, outside the
    stand-in package (tests/sim/test_fused_dtensor.py)."""
    spec = importlib.util.spec_from_file_location(f"torch_npu.{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checked = _sibling("_op_support").checked  # dtypes CANN refuses (the table shared with the CANN emulation)

_REFERENCE_MODULE = "npu_inject.ops.reference"


def _reference(name: str):
    """The reference kernel, refusing the dtypes CANN refuses (the shared operator table, _op_support)."""
    return checked(name, getattr(importlib.import_module(_REFERENCE_MODULE), name))


def _fresh(tensors):
    """Custom-op outputs may not alias inputs or each other."""
    if isinstance(tensors, torch.Tensor):
        return tensors.contiguous().clone()
    return tuple(t.contiguous().clone() for t in tensors)


# -- rms_norm --------------------------------------------------------------------------


@torch.library.custom_op("npu::npu_rms_norm", mutates_args=(),
                         schema="(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
def npu_rms_norm(self, gamma, epsilon=1e-06):
    return _fresh(_reference("npu_rms_norm")(self, gamma, epsilon))


@npu_rms_norm.register_fake
def _(self, gamma, epsilon=1e-06):
    rstd_shape = [*self.shape[: self.dim() - gamma.dim()], *([1] * gamma.dim())]
    return torch.empty_like(self), self.new_empty(rstd_shape, dtype=torch.float32)


@torch.library.custom_op("npu::npu_rms_norm_backward", mutates_args=(),
                         schema="(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)")
def npu_rms_norm_backward(dy, self, gamma, rstd):
    return _fresh(_reference("npu_rms_norm_backward")(dy, self, gamma, rstd))


@npu_rms_norm_backward.register_fake
def _(dy, self, gamma, rstd):
    return torch.empty_like(self), torch.empty_like(gamma)


def _rms_norm_setup(ctx, inputs, output):
    x, gamma, _epsilon = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _rms_norm_backward(ctx, grad_out, _grad_rstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(grad_out, x, gamma, rstd)
    return dx, dgamma, None


npu_rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


@register_sharding(torch.ops.npu.npu_rms_norm.default)
def _rms_norm_strategy(x, gamma, epsilon=1e-06):
    strategies = [([Replicate(), Replicate()], [Replicate(), Replicate(), None])]
    for dim in range(x.ndim - gamma.ndim):
        strategies.append(([Shard(dim), Shard(dim)], [Shard(dim), Replicate(), None]))
    return strategies


@register_sharding(torch.ops.npu.npu_rms_norm_backward.default)
def _rms_norm_backward_strategy(dy, x, gamma, rstd):
    strategies = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), Replicate()])]
    for dim in range(x.ndim - gamma.ndim):
        strategies.append(([Shard(dim), Partial()], [Shard(dim), Shard(dim), Replicate(), Shard(dim)]))
    return strategies


# -- rotary_mul ------------------------------------------------------------------------


@torch.library.custom_op(
    "npu::npu_rotary_mul", mutates_args=(),
    schema="(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor")
def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    return _fresh(_reference("npu_rotary_mul")(self, r1, r2, rotary_mode, rotate))


@npu_rotary_mul.register_fake
def _(self, r1, r2, rotary_mode="half", rotate=None):
    return torch.empty_like(self)


@torch.library.custom_op(
    "npu::npu_rotary_mul_backward", mutates_args=(),
    schema="(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> (Tensor, Tensor, Tensor)")
def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode="half"):
    return _fresh(_reference("npu_rotary_mul_backward")(grad, self, r1, r2, rotary_mode))


@npu_rotary_mul_backward.register_fake
def _(grad, self, r1, r2, rotary_mode="half"):
    return torch.empty_like(self), torch.empty_like(r1, dtype=self.dtype), torch.empty_like(r2, dtype=self.dtype)


def _rotary_setup(ctx, inputs, output):
    x, r1, r2, rotary_mode, rotate = inputs
    if rotate is not None:
        raise NotImplementedError("npu_rotary_mul (simulated): rotate has no backward in torch_npu")
    ctx.rotary_mode = rotary_mode
    ctx.save_for_backward(x, r1, r2)


def _rotary_backward(ctx, grad):
    x, r1, r2 = ctx.saved_tensors
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, ctx.rotary_mode)
    return dx, dr1.to(r1.dtype), dr2.to(r2.dtype), None, None


npu_rotary_mul.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def _sharded_like_x(x, r, dim):
    return Replicate() if r.shape[dim] == 1 and x.shape[dim] != 1 else Shard(dim)


@register_sharding(torch.ops.npu.npu_rotary_mul.default)
def _rotary_strategy(x, r1, r2, rotary_mode="half", rotate=None):
    strategies = [([Replicate()], [Replicate(), Replicate(), Replicate(), None, None])]
    for dim in range(x.ndim - 1):  # the last (head) dim is rotated as a whole
        r = _sharded_like_x(x, r1, dim)
        strategies.append(([Shard(dim)], [Shard(dim), r, r, None, None]))
    return strategies


@register_sharding(torch.ops.npu.npu_rotary_mul_backward.default)
def _rotary_backward_strategy(grad, x, r1, r2, rotary_mode="half"):
    strategies = [([Replicate()] * 3, [Replicate()] * 4 + [None])]
    for dim in range(x.ndim - 1):
        r = _sharded_like_x(x, r1, dim)
        dr = Partial() if isinstance(r, Replicate) else Shard(dim)
        strategies.append(([Shard(dim), dr, dr], [Shard(dim), Shard(dim), r, r, None]))
    return strategies


# -- swiglu ----------------------------------------------------------------------------


@torch.library.custom_op("npu::npu_swiglu", mutates_args=(), schema="(Tensor self, int dim=-1) -> Tensor")
def npu_swiglu(self, dim=-1):
    return _fresh(_reference("npu_swiglu")(self, dim))


@npu_swiglu.register_fake
def _(self, dim=-1):
    shape = list(self.shape)
    shape[dim] //= 2
    return self.new_empty(shape)


@torch.library.custom_op("npu::npu_swiglu_backward", mutates_args=(),
                         schema="(Tensor grad_output, Tensor self, int dim=-1) -> Tensor")
def npu_swiglu_backward(grad_output, self, dim=-1):
    return _fresh(_reference("npu_swiglu_backward")(grad_output, self, dim))


@npu_swiglu_backward.register_fake
def _(grad_output, self, dim=-1):
    return torch.empty_like(self)


def _swiglu_setup(ctx, inputs, output):
    x, dim = inputs
    ctx.dim = dim
    ctx.save_for_backward(x)


def _swiglu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward(grad, x, ctx.dim), None


npu_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def _unsplit_dims(x, dim):
    split = dim % x.ndim
    return [d for d in range(x.ndim) if d != split]


@register_sharding(torch.ops.npu.npu_swiglu.default)
def _swiglu_strategy(x, dim=-1):
    return [([Replicate()], [Replicate(), None])] + [([Shard(d)], [Shard(d), None]) for d in _unsplit_dims(x, dim)]


@register_sharding(torch.ops.npu.npu_swiglu_backward.default)
def _swiglu_backward_strategy(grad_output, x, dim=-1):
    return [([Replicate()], [Replicate(), Replicate(), None])] + [
        ([Shard(d)], [Shard(d), Shard(d), None]) for d in _unsplit_dims(x, dim)
    ]
