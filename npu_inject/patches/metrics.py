"""MFU against the peak of the device the run uses: cited Ascend BF16 peaks, the host's measured peak in the rehearsal.

torchtitan's ``get_peak_flops(device_name)`` (``torchtitan.tools.utils``, read
through the module by ``MetricsProcessor`` and ``Trainer``) knows no Ascend part and
falls back to A100's 312 TFLOPS, so MFU on an NPU is off by the ratio of the peaks.

* NPU target: the device name ``torch.npu.get_device_name()`` reports is looked up in
  ``ASCEND_BF16_PEAK_FLOPS`` (dense BF16 Cube peaks; the source is cited per entry).
  Option ``peak_tflops`` (> 0) overrides the table, e.g. for a part it does not list.
  A name the table does not know and no override: MFU becomes NaN (``mfu: nan%``) and
  the fallback is logged once and reported -- never another device's peak.
* CPU rehearsal: no datasheet figure describes what this process's threads can do, so the
  peak is measured once per process: the best of five 512x512x512 matmuls in float32, and in
  bfloat16 too where the CPU computes it natively (AVX-512 BF16, AMX), the faster of the two,
  with the process's own thread count. The rehearsal's log then shows an MFU against the host's
  measured matmul peak (the report says so and gives the figure), never ``nan%``; option
  ``peak_tflops`` overrides it as on the NPU.
"""

from __future__ import annotations

import functools
import math
import time

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.tools.utils:get_peak_flops",
)

# Dense BF16 Cube-unit peak FLOP/s per Ascend device name (what torch.npu.get_device_name()
# returns). Every figure is cited from Huawei's torchtitan plugin, torchtitan-npu
# (github.com/torchtitan-npu/torchtitan-npu, torchtitan_npu/patches/tools/metrics.py at
# commit 8f04da75, "MFU uses the BF16 Cube peak rather than the larger total-throughput
# figure"); its comments give the total/Cube pair quoted below. No per-SKU Huawei
# datasheet figure was found to cross-check them.
ASCEND_BF16_PEAK_FLOPS = {
    "Ascend910B1": 373.88e12,  # torchtitan-npu: total 400T, Cube 373T (Atlas A2)
    "Ascend910B2": 353.8944e12,  # torchtitan-npu: total 376T, Cube 353T (Atlas A2)
    "Ascend910B3": 294.912e12,  # torchtitan-npu: total 313T, Cube 294T (Atlas A2)
    "Ascend910B4": 245.76e12,  # torchtitan-npu: total 280T, Cube 245T (Atlas A2)
    "Ascend910_9392": 353.8944e12,  # torchtitan-npu: total 376T, Cube 353T (Atlas A3 die)
    "Ascend910_9362": 353.8944e12,  # torchtitan-npu: total 376T, Cube 353T (Atlas A3 die)
}
# Not listed (no cited figure): the other A3 dies (Ascend910_9391, _9381, _9382, _9372).
# Variant names carrying a listed name (e.g. "Ascend910B2C") take that entry, as
# torchtitan-npu matches them.


def ascend_peak_flops(device_name: str) -> float | None:
    """The cited peak for ``device_name`` (longest listed name it contains), or None."""
    matches = [name for name in ASCEND_BF16_PEAK_FLOPS if name in device_name]
    if not matches:
        return None
    return ASCEND_BF16_PEAK_FLOPS[max(matches, key=len)]


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


def apply(ctx: PatchContext) -> None:
    override_tflops = float(ctx.options["peak_tflops"])  # option_rules: >= 0; 0 = use the table

    def get_peak_flops(original, device_name: str) -> float:
        if override_tflops > 0:
            ctx.note(f"peak FLOPs for {device_name!r}: {override_tflops} TFLOPS (option peak_tflops)")
            return override_tflops * 1e12
        if ctx.device_kind == "cpu":
            rate, how = measured_host_peak_flops()
            ctx.note(f"MFU in the CPU rehearsal is against the {how}")
            return rate
        peak = ascend_peak_flops(device_name)
        if peak is None:
            ctx.fallback(
                f"no cited BF16 peak for device {device_name!r} (known: "
                f"{', '.join(ASCEND_BF16_PEAK_FLOPS)}): MFU is NaN; set the metrics option "
                "peak_tflops in a user registry (TORCHTITAN_NPU_REGISTRY) to give one"
            )
            return math.nan
        ctx.note(f"peak FLOPs for {device_name!r}: {peak / 1e12:.2f} TFLOPS (BF16 Cube, cited table)")
        return peak

    ctx.wrap("get_peak_flops", get_peak_flops)
