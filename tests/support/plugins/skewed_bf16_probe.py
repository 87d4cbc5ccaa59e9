"""TEST ONLY: rehearsal_dtype's CPU probe says no bf16 on rank 0 and bf16 on the other ranks

TEST ONLY: rehearsal_dtype's CPU probe answers differently per rank.

Rank 0's probe says the CPU has no bf16 instructions (and times bf16 30x slower than fp32), every
other rank's says it has them: ranks deciding from their own probe would pick float32 on rank 0 and
bfloat16 elsewhere. Rank 0's answer means float32, so the run stays fast on any CPU.
"""

import os

TARGETS = (
    "npu_inject.patches.rehearsal_dtype:cpu_probe",
)

RANK0_PROBE = (False, "no bf16 instructions (test)", 1e-3, 30e-3)  # (native, flags, fp32 s, bf16 s)
OTHER_RANKS_PROBE = (True, "the CPU has avx512_bf16 (test)", 1e-3, 0.5e-3)


def skewed_cpu_probe() -> tuple[bool, str, float, float]:
    return RANK0_PROBE if os.environ.get("RANK", "0") == "0" else OTHER_RANKS_PROBE


def apply(ctx):
    ctx.replace("npu_inject.patches.rehearsal_dtype:cpu_probe", skewed_cpu_probe)
