"""The CPU rehearsal's compute dtype: decided by what the CPU's instruction set supports, not by a timing race.

Patch ``rehearsal_dtype`` applies the decision to the job, rank 0's probe deciding for every rank;
``npu-inject plan --hardware cpu`` plans the job in the dtype it decides on this host. A CPU with bf16
instructions (x86 AVX-512 BF16 or AMX, Arm's BF16 extension; :mod:`npu_inject.cpu_features`) computes a bf16
job in bf16; one without emulates bf16 matmuls 4-130x slower than fp32, so the job computes in float32. A
probe matmul in both dtypes is timed too, for the report only: under load its ratio moved from 0.9x to 13.8x on
one host, which once flipped the choice between two runs of the same job.
"""

from __future__ import annotations

import time

from npu_inject.cpu_features import describe_bf16, native_bf16

_PROBE_SHAPE = (256, 512, 512)  # (M, K, N) of the probe matmul


def bf16_slowdown() -> tuple[float, float, float]:
    """(fp32 seconds, bf16 seconds, ratio) of the best of three probe matmuls each."""
    import torch

    m, k, n = _PROBE_SHAPE
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        torch.matmul(a, b)  # warm-up: first-call allocation and kernel selection
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - started)
        timings[dtype] = best
    fp32, bf16 = timings[torch.float32], timings[torch.bfloat16]
    return fp32, bf16, bf16 / fp32


def cpu_probe() -> tuple[bool, str, float, float]:
    """(native bf16 per the CPU's flags, which flags say so, fp32 and bf16 probe seconds for the report)."""
    fp32, bf16, _ = bf16_slowdown()
    return native_bf16(), describe_bf16(), fp32, bf16


def decide(choice: str, configured: str, probe: tuple[bool, str, float, float] | None) -> tuple[str, str]:
    """(dtype to compute in, the sentence saying so and why) for option ``compute_dtype`` = ``choice``
    and the job's ``mixed_precision_param`` = ``configured``; ``probe``: rank 0's :func:`cpu_probe`, for auto."""
    if choice == "keep":
        return configured, (f"rehearsal computes in {configured}: the job's training.mixed_precision_param, "
                            "kept by registry option compute_dtype=keep")
    if choice == "float32":
        return "float32", ("rehearsal computes in float32: registry option compute_dtype=float32 "
                           f"(the job's training.mixed_precision_param is {configured})")
    if configured == "float32":
        return "float32", ("rehearsal computes in float32: the job's training.mixed_precision_param "
                           "(compute_dtype=auto decides only for a bfloat16 job)")
    if probe is None:
        raise ValueError(f"rehearsal_dtype: compute_dtype=auto with mixed_precision_param={configured!r} "
                         "needs rank 0's probe, got none")
    native, flags, fp32, bf16 = probe
    timed = (f"rank 0's probe {_PROBE_SHAPE[0]}x{_PROBE_SHAPE[1]}x{_PROBE_SHAPE[2]} matmul, for information: "
             f"fp32 {fp32 * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms ({bf16 / fp32:.1f}x)")
    if not native:
        return "float32", (f"rehearsal computes in float32 instead of {configured}: the CPU has no bf16 "
                           f"instructions ({flags}; {timed}); registry option compute_dtype=keep keeps {configured}")
    return configured, f"rehearsal computes in {configured}: {flags} ({timed})"
