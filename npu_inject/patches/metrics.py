"""MFU against the peak of the device the run uses: its profile's BF16 peak; in the rehearsal one host peak on every rank.

torchtitan's ``get_peak_flops(device_name)`` (``torchtitan.tools.utils``, read
through the module by ``MetricsProcessor`` and ``Trainer``) knows no Ascend part and
falls back to A100's 312 TFLOPS, so MFU on an NPU is off by the ratio of the peaks.

* NPU target: the device name ``torch.npu.get_device_name()`` reports is looked up in the
  hardware profiles (``npu_inject/hardware.json``, the planner's: dense BF16 cube peaks, each
  with its source; a variant name carrying a listed one, such as ``Ascend910B2C``, takes it).
  Option ``peak_tflops`` (> 0) overrides them, e.g. for a part they do not list. A name they do
  not know and no override: MFU becomes NaN (``mfu: nan%``) and the fallback is logged once and
  reported -- never another device's peak.
* CPU rehearsal: no datasheet figure describes what this process's threads can do, and a peak
  measured by each rank for itself differed by 5x between runs and ranks under load (2.3e10 to
  1.29e11 FLOP/s seen; two ranks printed 27% and 46% MFU for the same step). Every rank divides by
  one peak, in this order: option ``peak_tflops`` (> 0); the ``cpu`` profile of a hardware file
  (``TORCHTITAN_NPU_HARDWARE``, as ``npu-inject calibrate`` on this host writes it: its best matmul
  rate, the faster of bf16 and fp32); else rank 0's measurement (``npu_inject.host_peak``: the fastest
  of a tenth of a second of 512x512x512 matmuls after a warm-up, in bf16 too where the CPU computes it
  natively), taken by rank 0 alone when the patch applies and handed to every rank when the process
  group starts (``PatchContext.agree_with_rank0``).
  The rehearsal's log shows an MFU against it, never ``nan%``; the report says which peak and where
  it came from. Called before the ranks agreed (outside a ``Trainer``), it divides by this process's
  own measurement and reports that as a fallback.
"""

from __future__ import annotations

import math
import os

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


def calibrated_host_peak() -> tuple[float, str] | None:
    """(FLOP/s, its source) of a hardware file's ``cpu`` profile (npu-inject calibrate on this host), or None."""
    catalog = hardware.load()
    if hardware.CPU not in catalog.profiles:
        return None
    profile = catalog.profiles[hardware.CPU]
    dtype = max(("bf16", "fp32"), key=lambda short: profile.peak_tflops.get(short, 0.0))
    origin = os.environ.get(hardware.ENV_FILE) or hardware.PACKAGED
    return profile.peak(dtype), (f"calibrated cpu profile's {dtype} matmul peak "
                                 f"{profile.peak(dtype) / 1e9:.1f} GFLOP/s ({origin}: "
                                 f"{profile.sources.get(f'peak_tflops.{dtype}', 'no source given')})")


def apply(ctx: PatchContext) -> None:
    override_tflops = float(ctx.options["peak_tflops"])  # option_rules: >= 0; 0 = use the table
    host_peak: dict[str, tuple[float, str]] = {}  # "agreed" or "calibrated": (FLOP/s, where it comes from)

    if ctx.device_kind == "cpu" and override_tflops <= 0:
        try:
            calibrated = calibrated_host_peak()
        except ConfigError as exc:
            calibrated = None
            ctx.fallback(f"{exc}: MFU against rank 0's measured host peak instead")
        if calibrated is not None:
            host_peak["calibrated"] = calibrated
        else:
            def use_rank0_peak(measured: tuple[float, str] | None) -> None:
                if measured is None:  # a rank other than 0 alone: a fake process group exchanges nothing
                    measured = measured_host_peak_flops()
                    ctx.note("the host peak was measured by this process: its process group exchanged none")
                host_peak["agreed"] = measured

            # Measured now, while torchtitan is imported: the proposal must exist before the process group
            # does (Trainer.init_distributed, where the runtime hands every rank rank 0's). Only rank 0
            # measures: the other ranks' probes would share its cores and slow it.
            rank0 = int(os.environ.get("RANK", "0")) == 0
            ctx.agree_with_rank0("host_peak", measured_host_peak_flops() if rank0 else None, use_rank0_peak)

    def rehearsal_peak() -> float:
        if "calibrated" in host_peak:
            rate, how = host_peak["calibrated"]
            ctx.note(f"MFU in the CPU rehearsal is against the {how}, the same on every rank")
        elif "agreed" in host_peak:
            rate, how = host_peak["agreed"]
            ctx.note(f"MFU in the CPU rehearsal is against the {how}: rank 0's measurement, the same on every rank")
        else:
            rate, how = measured_host_peak_flops()
            ctx.fallback(f"MFU against this process's own {how}: get_peak_flops ran before the ranks agreed on "
                         "rank 0's (Trainer.init_distributed); other ranks may divide by another peak")
        return rate

    def get_peak_flops(original, device_name: str) -> float:
        if override_tflops > 0:
            ctx.note(f"peak FLOPs for {device_name!r}: {override_tflops} TFLOPS (option peak_tflops)")
            return override_tflops * 1e12
        if ctx.device_kind == "cpu":
            return rehearsal_peak()
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
