"""SwiGLU ``silu(gate) * up`` as one ``npu_swiglu`` call.

``npu_swiglu(x, dim)`` splits x in two halves along ``dim``: gate first, up second. The
two projections are computed as upstream computes them (checkpoints keep w1 and w3
apart) and joined along a new axis next to the last one, so the hidden dim F -- which
tensor parallel shards -- is not the split axis and the kernel stays local to each
shard.
"""

from __future__ import annotations

import torch

from npu_inject.ops import kernels

GATE_UP_DIM = -2  # the axis of (gate, up) in the stacked input


def swiglu(gate_RF: torch.Tensor, up_RF: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate_RF) * up_RF`` through npu_swiglu (any leading dims; shapes and dtypes equal)."""
    if gate_RF.shape != up_RF.shape or gate_RF.dtype != up_RF.dtype:
        raise ValueError(
            f"npu_inject swiglu: gate {tuple(gate_RF.shape)} {gate_RF.dtype} and up {tuple(up_RF.shape)} "
            f"{up_RF.dtype} must have the same shape and dtype"
        )
    gate_up_R2F = torch.stack([gate_RF, up_RF], dim=GATE_UP_DIM)
    return kernels().npu_swiglu(gate_up_R2F, dim=GATE_UP_DIM).squeeze(GATE_UP_DIM)
