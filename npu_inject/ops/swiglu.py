"""SwiGLU ``silu(gate) * up`` as one ``npu_swiglu`` call.

``npu_swiglu(x, dim)`` splits x in two halves along ``dim``: gate first, up second. The
two projections are computed as upstream computes them (checkpoints keep w1 and w3
apart) and joined along a new axis next to the last one, so the hidden dim F -- which
tensor parallel shards -- is not the split axis and the kernel stays local to each
shard. :func:`swiglu_backward` is the backward kernel (``npu_swiglu_backward``) on the same
layout, for callers that own their autograd (a custom op's backward).
"""

from __future__ import annotations

import torch

from npu_inject.ops import kernels

GATE_UP_DIM = -2  # the axis of (gate, up) in the stacked input


def _check(gate_RF: torch.Tensor, up_RF: torch.Tensor) -> None:
    if gate_RF.shape != up_RF.shape or gate_RF.dtype != up_RF.dtype:
        raise ValueError(
            f"npu_inject swiglu: gate {tuple(gate_RF.shape)} {gate_RF.dtype} and up {tuple(up_RF.shape)} "
            f"{up_RF.dtype} must have the same shape and dtype"
        )


def swiglu(gate_RF: torch.Tensor, up_RF: torch.Tensor, gate_up_dim: int = GATE_UP_DIM) -> torch.Tensor:
    """``F.silu(gate_RF) * up_RF`` through npu_swiglu (any leading dims; shapes and dtypes equal).

    ``gate_up_dim=0`` stacks (gate, up) first: their gradients are then the two contiguous halves of
    the kernel's, where next to the last axis each is strided (rows twice as far apart).
    """
    _check(gate_RF, up_RF)
    gate_up = torch.stack([gate_RF, up_RF], dim=gate_up_dim)
    return kernels().npu_swiglu(gate_up, dim=gate_up_dim).squeeze(gate_up_dim)


def swiglu_backward(
    grad_RF: torch.Tensor, gate_RF: torch.Tensor, up_RF: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``F.silu(gate_RF) * up_RF`` for output gradient ``grad_RF``, one npu_swiglu_backward."""
    _check(gate_RF, up_RF)
    gate_up_R2F = torch.stack([gate_RF, up_RF], dim=GATE_UP_DIM)
    grad_R1F = grad_RF.to(gate_RF.dtype).unsqueeze(GATE_UP_DIM)  # npu_swiglu's output: half of the split axis
    grad_gate_up_R2F = kernels().npu_swiglu_backward(grad_R1F, gate_up_R2F, dim=GATE_UP_DIM)
    grad_gate_RF, grad_up_RF = grad_gate_up_R2F.unbind(GATE_UP_DIM)
    return grad_gate_RF, grad_up_RF
