"""torch_npu.optim stand-in: fused optimizers with torch.optim semantics."""

from __future__ import annotations

from typing import Any

import torch


class NpuFusedAdamW(torch.optim.AdamW):
    """AdamW with torch.optim.AdamW's exact semantics (multi-tensor path).

    The real NpuFusedAdamW fuses the update on device; numerically it follows
    AdamW, which is what the simulator needs to reproduce.
    """

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("fused"):
            raise ValueError(
                "NpuFusedAdamW is already the fused optimizer; do not pass fused=True."
            )
        if kwargs.get("foreach") is False:
            raise ValueError("NpuFusedAdamW always uses the multi-tensor path; do not pass foreach=False.")
        kwargs["foreach"] = True
        super().__init__(params, *args, **kwargs)


__all__ = ["NpuFusedAdamW"]
