"""The host's matmul peak, measured: what the CPU rehearsal calls its device's peak FLOP/s.

No datasheet figure describes what this process's threads can do, so the peak is measured once per
process: the best of five 512x512x512 matmuls in float32, and in bfloat16 too where the CPU computes
it natively (AVX-512 BF16, AMX), the faster of the two, with the process's own thread count. The
``metrics`` patch divides the rehearsal's MFU by rank 0's measurement on every rank (unless a calibrated
``cpu`` profile gives the peak); :func:`npu_inject.hardware.measure_host` makes this host a device
profile from it. torch is imported when the probe runs, not at import.
"""

from __future__ import annotations

import functools
import math
import time

HOST_PROBE_SIZE = 512  # n of the n x n x n probe matmul: large enough to run at the host's matmul speed


@functools.lru_cache(maxsize=None)
def measured_host_peak_flops() -> tuple[float, str]:
    """(FLOP/s, how it was measured): the host's best matmul rate for this process's threads."""
    import torch

    n = HOST_PROBE_SIZE
    dtypes = [torch.float32]
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        dtypes.append(torch.bfloat16)  # native there; emulated bf16 is 30-130x slower and never the peak
    rates = {}
    for dtype in dtypes:
        # Constant operands: drawing random ones would move the job's seeded random stream.
        a, b = torch.full((n, n), 0.5, dtype=dtype), torch.full((n, n), 0.25, dtype=dtype)
        torch.mm(a, b)  # warm-up: first-call allocation and kernel selection
        best = math.inf
        for _ in range(5):
            started = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - started)
        rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / best
    dtype, rate = max(rates.items(), key=lambda item: item[1])
    return rate, (f"host matmul peak {rate / 1e9:.1f} GFLOP/s measured in {dtype} ({n}x{n}x{n}, best of 5, "
                  f"{torch.get_num_threads()} thread(s)); not a datasheet figure")
