"""MFU against the peak of the device the run uses: its hardware profile's BF16 peak, the host's measured peak in the rehearsal.

torchtitan's ``get_peak_flops(device_name)`` (``torchtitan.tools.utils``, read
through the module by ``MetricsProcessor`` and ``Trainer``) knows no Ascend part and
falls back to A100's 312 TFLOPS, so MFU on an NPU is off by the ratio of the peaks.

* NPU target: the device name ``torch.npu.get_device_name()`` reports is looked up in the
  hardware profiles (``npu_inject/hardware.json``, the planner's: dense BF16 cube peaks, each
  with its source; a variant name carrying a listed one, such as ``Ascend910B2C``, takes it).
  Option ``peak_tflops`` (> 0) overrides them, e.g. for a part they do not list. A name they do
  not know and no override: MFU becomes NaN (``mfu: nan%``) and the fallback is logged once and
  reported -- never another device's peak.
* CPU rehearsal: no datasheet figure describes what this process's threads can do, so the
  peak is measured once per process: the best of five 512x512x512 matmuls in float32, and in
  bfloat16 too where the CPU computes it natively (AVX-512 BF16, AMX), the faster of the two,
  with the process's own thread count. The rehearsal's log then shows an MFU against the host's
  measured matmul peak (the report says so and gives the figure), never ``nan%``; option
  ``peak_tflops`` overrides it as on the NPU.
"""

from __future__ import annotations

import math

from npu_inject import hardware
from npu_inject.errors import ConfigError
from npu_inject.host_peak import measured_host_peak_flops
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.tools.utils:get_peak_flops",
)


def ascend_peak_flops(device_name: str) -> tuple[float, str] | None:
    """(BF16 peak FLOP/s, its source) of the profile for ``device_name``, or None when none fits."""
    try:
        profile = hardware.load().find(device_name)
    except ConfigError:
        return None
    return profile.peak("bfloat16"), profile.sources["peak_tflops.bf16"]


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
        found = ascend_peak_flops(device_name)
        if found is None:
            ctx.fallback(
                f"no hardware profile for device {device_name!r} (known: {', '.join(hardware.load().names())}): "
                "MFU is NaN; set the metrics option peak_tflops in a user registry (TORCHTITAN_NPU_REGISTRY), "
                f"or add a profile ({hardware.ENV_FILE})"
            )
            return math.nan
        peak, source = found
        ctx.note(f"peak FLOPs for {device_name!r}: {peak / 1e12:.2f} TFLOPS (BF16 cube; {source})")
        return peak

    ctx.wrap("get_peak_flops", get_peak_flops)
