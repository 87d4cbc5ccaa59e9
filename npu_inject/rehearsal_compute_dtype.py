"""The CPU rehearsal's compute dtype: whether this CPU runs bf16 natively (a probe), and the decision.

Patch ``rehearsal_dtype`` applies the decision to the job, rank 0's probe deciding for every rank;
``npu-inject plan --hardware cpu`` plans the job in the dtype it decides on this host.
"""

from __future__ import annotations

import time

SLOW_FACTOR = 4.0  # emulated bf16 measures ~30x slower; native bf16 about as fast as fp32 or faster
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


def decide(choice: str, configured: str, figures: tuple[float, float, float] | None) -> tuple[str, str]:
    """(dtype to compute in, the sentence saying so and why) for option ``compute_dtype`` = ``choice``
    and the job's ``mixed_precision_param`` = ``configured``; ``figures``: rank 0's probe, for auto."""
    if choice == "keep":
        return configured, (f"rehearsal computes in {configured}: the job's training.mixed_precision_param, "
                            "kept by registry option compute_dtype=keep")
    if choice == "float32":
        return "float32", ("rehearsal computes in float32: registry option compute_dtype=float32 "
                           f"(the job's training.mixed_precision_param is {configured})")
    if configured == "float32":
        return "float32", ("rehearsal computes in float32: the job's training.mixed_precision_param "
                           "(compute_dtype=auto probes only a bfloat16 job)")
    if figures is None:
        raise ValueError(f"rehearsal_dtype: compute_dtype=auto with mixed_precision_param={configured!r} "
                         "needs rank 0's probe figures, got none")
    fp32, bf16, ratio = figures
    measured = (f"rank 0's probe {_PROBE_SHAPE[0]}x{_PROBE_SHAPE[1]}x{_PROBE_SHAPE[2]} matmul: "
                f"fp32 {fp32 * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms ({ratio:.1f}x)")
    if ratio > SLOW_FACTOR:
        return "float32", (f"rehearsal computes in float32 instead of {configured}: the CPU has no native "
                           f"bf16 ({measured}); registry option compute_dtype=keep keeps {configured}")
    return configured, f"rehearsal computes in {configured}: the CPU runs bf16 natively ({measured})"
