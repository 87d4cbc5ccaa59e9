"""TEST ONLY: rehearsal_dtype's bf16 probe says emulated on rank 0 and native on the other ranks

TEST ONLY: rehearsal_dtype's bf16 probe answers differently per rank.

Rank 0's probe says bf16 is emulated (30x slower than fp32), every other rank's says bf16 is
native (2x faster): ranks deciding from their own probe would pick float32 on rank 0 and
bfloat16 elsewhere. Rank 0's answer means float32, so the run stays fast on any CPU.
"""

import os

TARGETS = (
    "npu_inject.patches.rehearsal_dtype:bf16_slowdown",
)

RANK0_FIGURES = (1e-3, 30e-3, 30.0)  # (fp32 s, bf16 s, ratio): emulated bf16
OTHER_RANKS_FIGURES = (1e-3, 0.5e-3, 0.5)  # native bf16


def skewed_bf16_slowdown() -> tuple[float, float, float]:
    return RANK0_FIGURES if os.environ.get("RANK", "0") == "0" else OTHER_RANKS_FIGURES


def apply(ctx):
    ctx.replace("npu_inject.patches.rehearsal_dtype:bf16_slowdown", skewed_bf16_slowdown)
