"""Write the Ascend profiles' kernel rates (``npu_inject/hardware_rates/<profile>.json``) from public measurements.

No Ascend NPU is reachable from this project, so the Ascend profiles' rates come from what others measured
and published, each point carrying its source; where nothing public exists the point is marked EST with its
reasoning. ``npu-inject calibrate`` on a real Ascend machine replaces all of them (its file, passed with
``--hardware-file``, takes precedence). Run after changing a figure below:

    python tools/make_ascend_rates.py

The sources (read 2026-11-26, PTO's watermark and WAN 2026-11-30; docs/planner.md lists them with what each cannot show):

ZZC   github.com/zzc0721/torch-performance-test-data issue #109, "Ascend910B2" (torch 2.5.1): torch.mm of N x N
      BF16 99.86 / 248.30 / 315.36 / 301.23 / 300.94 TFLOP/s at N = 1024 / 2048 / 4096 / 8192 / 10240; FP32
      46.30 / 76.92 / 84.53 / 80.43 / 79.69 (wall clock over 30 calls: the 1024 point is the host's pace).
PTO   github.com/hw-native-sys/pto-isa kernels/manual/common/flash_atten/README.md (910B2) and
      kernels/python/flash_atten/README.md (an A3 die): torch_npu's fused attention (inference kernel), one head,
      head dim 128, forward: 0.21 / 0.27 / 0.35 / 0.43 of the cube peak at 4K / 8K / 16K / 32K (910B2),
      0.33 / 0.39 / 0.49 / 0.51 / 0.52 at 8K-128K (A3 die); .claude/skills/pto-isa-flash-atten-a3-pipeline/
      references/fa-4stage-pipeline-recipe.md at 5a40ed77 ("Regression watermark on Ascend 910B2", the same
      harness): torch_npu 365.81 / 974.65 / 3159.95 / 12152.60 / 48061.93 us at 8K-128K, 0.27 / 0.40 / 0.49 /
      0.51 / 0.52 of the 910B2's peak (non-causal, one head, batch 1).
WAN   github.com/xysheng-colossal/Wan2.1 docs/operator_optimization_experiments.md at 0eba4476: torch_npu.
      npu_fusion_attention (the training kernel) at [1, 32760, 10, 128] BSND, bf16, no mask: 40.0 ms forward, 137
      TFLOP/s, 0.39 of a 910B2's peak (the SoC not stated).
FGG   github.com/flagos-ai/FlagGems PR #6325 (torch_npu baseline, SKU not stated): npu_grouped_matmul with 32-80
      rows per expert streams its weights at 1.46-1.49 TB/s (47-121 TFLOP/s).
FGS   github.com/flagos-ai/FlagGems PR #6324 (torch_npu baseline, SKU not stated): npu_swiglu moves 1.21-1.22 TB/s
      at 0.8-2 GB; tiny kernels take 2.5-4.2 us on the device.
"""

from __future__ import annotations

import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from package_rates import write_rates  # noqa: E402

# Fraction of the BF16 cube peak a square bf16 matmul of side N reaches (ZZC, 910B2).
SQUARE = {1024: (0.50, "EST: ZZC's 1024 point (0.28) is the host's pace (21.5 us per call); a device rate between "
                       "it and the 2048 point"),
          2048: (0.70, "ZZC (910B2): 248.30 TFLOP/s at 2048^3"),
          4096: (0.89, "ZZC (910B2): 315.36 TFLOP/s at 4096^3"),
          8192: (0.85, "ZZC (910B2): 301.23 TFLOP/s at 8192^3; 300.94 at 10240^3")}
FP32_TFLOPS = (84.53, "ZZC (910B2): FP32 84.53 TFLOP/s at 4096^3 (76.92 at 2048, 80.43 at 8192)")
# Forward fused attention, fraction of the cube peak, by sequence length (head dim 128): (the point, its source,
# (low, high) the range its sources span, or an estimate's bounds, and why). The backward and the causal mask EST.
SINGLE = "EST +-15%: one measurement; PTO's two runs of the same kernel on the 910B2 differ by 13-15% at 16K-32K"
ATTENTION = {1024: (0.15, "EST: below PTO's 4K point; a single head's 0.03 at 1K under-fills the cores, "
                          "a training call's many heads do not", (0.10, 0.21), "EST: up to the 4K point"),
             4096: (0.21, "PTO (910B2, one head, forward, head dim 128): 0.21 of the peak at 4K", (0.18, 0.24), SINGLE),
             8192: (0.30, "PTO: 0.27 (910B2) and 0.33 (A3 die) at 8K, their mean", (0.27, 0.33),
                    "PTO: 0.27 (910B2, both runs), 0.33 (A3 die)"),
             16384: (0.37, "PTO: 0.35 (910B2) and 0.39 (A3 die) at 16K, their mean", (0.35, 0.40),
                     "PTO: 0.35 and 0.40 (910B2), 0.39 (A3 die)"),
             32768: (0.46, "PTO: 0.43 (910B2) and 0.49 (A3 die) at 32K, their mean", (0.39, 0.49),
                     "PTO: 0.43 and 0.49 (910B2), 0.49 (A3 die); WAN: npu_fusion_attention itself, 10 heads, 0.39"),
             65536: (0.51, "PTO (910B2 and A3 die): 0.51 at 64K", (0.43, 0.59), SINGLE + " (one harness's two labels)"),
             131072: (0.52, "PTO (910B2 and A3 die): 0.52 at 128K", (0.44, 0.60), SINGLE + " (one harness's two labels)")}
BACKWARD = 0.8  # EST: no Ascend measurement of FlashAttentionScoreGrad; FlashAttention-2's ratio on GPUs
# The backward's rate over the forward's that this project measured on the H100 SXM and H200 (npu-inject calibrate,
# 2026-11-26: FlashAttention-2, cuDNN and the efficient kernel, head dim 128, 4K-16K tokens, both masks).
BACKWARD_RANGE = (0.76, 0.95)
# A causal call's rate over a full one's, the same measurements (FlashAttention-2 and cuDNN, 4K-16K): 0.88-0.97.
CAUSAL_LOW = 0.88
MEMORY_FRACTION = (0.75, "FGS: npu_swiglu moves 1.21-1.22 TB/s of the 910B's 1.6 (SKU not stated)")
STREAM_FRACTION = (0.92, "FGG: npu_grouped_matmul streams its weights at 1.46-1.49 TB/s of 1.6 (SKU not stated)")
KERNEL_US = (3.0, "FGS: tiny kernels take 2.5-4.2 us on the device")
HOST_US = (20.0, "ZZC: at most 21.5 us per eager torch.mm call (910B2, torch 2.5.1); EST for other operators")
GRID = (128, 1024, 4096, 16384)


def _square_fraction(side: float) -> tuple[float, str]:
    sides = sorted(SQUARE)
    if side <= sides[0]:
        return SQUARE[sides[0]]
    if side >= sides[-1]:
        return SQUARE[sides[-1]]
    upper = next(s for s in sides if s >= side)
    lower = max(s for s in sides if s <= side)
    if upper == lower:
        return SQUARE[upper]
    t = (math.log2(side) - math.log2(lower)) / (math.log2(upper) - math.log2(lower))
    value = SQUARE[lower][0] + t * (SQUARE[upper][0] - SQUARE[lower][0])
    return value, f"EST: between ZZC's square points {lower}^3 and {upper}^3 (910B2) at the shape's geometric mean side"


def matmul_points(peak_tflops: float, hbm_gbps: float, scaled: str) -> list[dict]:
    points = []
    for dtype in ("bf16", "fp32"):
        for m in GRID:
            for n in GRID:
                for k in GRID:
                    side = round((m * n * k) ** (1 / 3), 6)
                    if dtype == "bf16":
                        fraction, source = _square_fraction(side)
                        compute = fraction * peak_tflops
                    else:
                        fraction, source = _square_fraction(side)
                        compute = FP32_TFLOPS[0] * fraction / SQUARE[4096][0]
                        source = f"{FP32_TFLOPS[1]}; scaled by the bf16 shape curve ({source})"
                    # A skinny product is bound by reading its operands: EST at the elementwise fraction of HBM.
                    moved = (m * k + k * n + m * n) * (2 if dtype == "bf16" else 4)
                    streaming = 2 * m * n * k / (moved / (hbm_gbps * 1e9 * MEMORY_FRACTION[0])) / 1e12
                    if streaming < compute:
                        compute, source = streaming, f"EST: bound by its operands' bytes at {MEMORY_FRACTION[0]} of HBM"
                    points.append({"dtype": dtype, "m": m, "n": n, "k": k, "tflops": round(compute, 3),
                                   "source": source + scaled})
    return points


def grouped_points(peak_tflops: float, hbm_gbps: float, scaled: str) -> list[dict]:
    """Grouped matmul, 8 groups: the weights streamed at FGG's fraction of HBM, or the dense rate at the per-group
    shape, whichever is slower."""
    points = []
    for m in (32, 512):
        for n in (1024, 4096):
            for k in (1024, 4096):
                dense = _square_fraction(round((m * n * k) ** (1 / 3), 6))[0] * peak_tflops
                weights = 8 * k * n * 2
                streaming = 2 * 8 * m * n * k / (weights / (hbm_gbps * 1e9 * STREAM_FRACTION[0])) / 1e12
                rate, source = ((streaming, STREAM_FRACTION[1] + ": weight-bound") if streaming < dense else
                                (dense, "EST: the dense grid's rate at the per-group shape"))
                points.append({"dtype": "bf16", "m": m, "n": n, "k": k, "groups": 8, "tflops": round(rate, 3),
                               "source": source + scaled})
    return points


def attention_points(peak_tflops: float, scaled: str) -> list[dict]:
    """Forward and backward points of both masks, each with the range its sources span (an estimate's bounds)."""
    points = []
    for seq, (fraction, source, (low, high), spread) in ATTENTION.items():
        for causal in (True, False):
            common = {"kernel": "npu_fusion_attention", "causal": causal, "head_dim": 128, "seq": seq}
            floor = low * (CAUSAL_LOW if causal else 1.0)
            masked = (f"; causal EST: the low end x {CAUSAL_LOW} (a causal call's rate over a full one's on the H100 "
                      "and H200, measured)") if causal else ""
            points.append({**common, "direction": "forward", "tflops": round(fraction * peak_tflops, 3),
                           "range": [round(floor * peak_tflops, 3), round(high * peak_tflops, 3)],
                           "source": f"{source}; range {floor:.2f}-{high:.2f}: {spread}{masked}{scaled}"})
            points.append({**common, "direction": "backward", "tflops": round(BACKWARD * fraction * peak_tflops, 3),
                           "range": [round(BACKWARD_RANGE[0] * floor * peak_tflops, 3),
                                     round(BACKWARD_RANGE[1] * high * peak_tflops, 3)],
                           "source": f"EST: {BACKWARD} x the forward ({source}); range {BACKWARD_RANGE[0]}-"
                                     f"{BACKWARD_RANGE[1]} x the forward's (the backward over the forward measured on "
                                     f"the H100 and H200, FlashAttention-2, cuDNN and efficient kernels){masked}{scaled}"})
    return points


def rates_for(name: str, profile: dict) -> dict:
    peak = profile["peak_tflops"]["bf16"]["value"]
    hbm = profile["memory_bandwidth_gbps"]["value"]
    scaled = "" if name == "Ascend910B2" else f"; scaled to {name}'s peaks (EST: the same cores, another bin or part)"
    memory = [{"op": "add", "dtype": dtype, "bytes": size, "gbps": round(MEMORY_FRACTION[0] * hbm, 1),
               "source": MEMORY_FRACTION[1] + scaled} for dtype in ("bf16", "fp32") for size in (1 << 20, 1 << 30)]
    fused = [{"kernel": kernel, "direction": direction, "dtype": "bf16", "bytes": size,
              "gbps": round(MEMORY_FRACTION[0] * hbm, 1),
              "source": (MEMORY_FRACTION[1] if kernel == "npu_swiglu" and direction == "forward" else
                         f"EST: as npu_swiglu's forward ({MEMORY_FRACTION[1]})") + scaled}
             for kernel in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu") for direction in ("forward", "backward")
             for size in (1 << 20, 1 << 30)]
    return {
        "about": f"{name}: public measurements of Ascend kernels (tools/make_ascend_rates.py lists them), not measured "
                 "by this project; npu-inject calibrate on the machine replaces them",
        "partial": False,
        "attention_kernel": "npu_fusion_attention",
        "kernel_us": {"value": KERNEL_US[0], "source": KERNEL_US[1]},
        "host_us": {"value": HOST_US[0], "source": HOST_US[1]},
        "memory": memory,
        "fused": fused,
        "matmul": matmul_points(peak, hbm, scaled) + grouped_points(peak, hbm, scaled),
        "attention": attention_points(peak, scaled),
    }


def main() -> None:
    with open(os.path.join(REPO, "npu_inject", "hardware.json"), encoding="utf-8") as handle:
        catalog = json.load(handle)
    for name, profile in catalog["profiles"].items():
        if profile["family"] != "ascend":
            continue
        path = os.path.join(REPO, "npu_inject", "hardware_rates", f"{name}.json")
        write_rates(rates_for(name, profile), path)
        print(f"wrote {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
