"""rehearsal_dtype: the CPU rehearsal computes in fp32 where the CPU has no native bf16.

torchtitan's default mixed precision computes in bf16 (``training.mixed_precision_param``,
applied by FSDP). A CPU without native bf16 instructions (x86 without AVX-512 BF16/AMX,
i.e. AVX2-only servers) emulates bf16 matmuls about 30x slower than fp32, so a debug
model rehearses at seconds per step instead of well under one. Option
``compute_dtype``:

* ``auto`` (default): once per process, time one bf16 and one fp32 matmul; when bf16 is
  more than ``SLOW_FACTOR`` times slower, train with ``mixed_precision_param=float32``
  (one log line, a report note with the figures). Otherwise keep the job's setting.
* ``float32``: always compute in fp32 in the rehearsal.
* ``keep``: keep what the job configured.

Parameters are fp32 either way (FSDP's ``param_dtype`` is the compute copy), so
checkpoints are unchanged. Runs only in the rehearsal: the NPU target keeps bf16.
"""

from __future__ import annotations

import logging
import time

from npu_inject.patching import PatchContext

logger = logging.getLogger("npu_inject")

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


def apply(ctx: PatchContext) -> None:
    choice = ctx.options["compute_dtype"]  # registry.json's option_rules: auto, float32 or keep
    decided: dict = {}

    def compute_dtype_for(configured: str) -> str:
        if choice == "keep" or configured == "float32":
            return configured
        if choice == "float32":
            return "float32"
        if "dtype" not in decided:
            fp32, bf16, ratio = bf16_slowdown()
            slow = ratio > SLOW_FACTOR
            decided["dtype"] = "float32" if slow else configured
            figures = (f"probe {_PROBE_SHAPE[0]}x{_PROBE_SHAPE[1]}x{_PROBE_SHAPE[2]} matmul: "
                       f"fp32 {fp32 * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms ({ratio:.1f}x)")
            if slow:
                message = (f"rehearsal computes in float32 instead of {configured}: this CPU has no native "
                           f"bf16 ({figures}); registry option compute_dtype=keep keeps {configured}")
                logger.warning("npu_inject: %s", message)
            else:
                message = f"rehearsal keeps {configured}: this CPU runs bf16 natively ({figures})"
            ctx.note(message)
        return decided["dtype"]

    def trainer_init(original, trainer, config, *args, **kwargs):
        training = config.training
        training.mixed_precision_param = compute_dtype_for(training.mixed_precision_param)
        return original(trainer, config, *args, **kwargs)

    ctx.wrap("Trainer.__init__", trainer_init)
