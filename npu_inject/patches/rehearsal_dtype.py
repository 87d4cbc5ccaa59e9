"""The CPU rehearsal computes in fp32 where the CPU has no bf16 instructions (rank 0's CPU decides for every rank).

torchtitan's default mixed precision computes in bf16 (``training.mixed_precision_param``,
applied by FSDP). A CPU without bf16 instructions (x86 without AVX-512 BF16/AMX,
i.e. AVX2-only servers) emulates bf16 matmuls 30-130x slower than fp32 (measured on this
project's CI machines), so a debug model rehearses at seconds per step instead of well under
one. Option ``compute_dtype``:

* ``auto`` (default): when the job asks for bf16, read the CPU's flags (and time one bf16 and one
  fp32 matmul for the report, once per process); without bf16 instructions, train with
  ``mixed_precision_param=float32``. The flags decide, not the timing, which load can skew.
  Rank 0's probe decides for the whole job: the ranks exchange it when the process group exists
  (``PatchContext.agree_with_rank0``), so ranks on different hosts still shard with one FSDP
  compute dtype.
* ``float32``: always compute in fp32 in the rehearsal.
* ``keep``: keep what the job configured.

Every rank logs one line saying which dtype it computes in and why (the probe's figures,
the option, or the job's setting), and notes it in the report. Parameters are fp32 either
way (FSDP's ``param_dtype`` is the compute copy), so checkpoints are unchanged. Runs only
in the rehearsal: the NPU target keeps bf16.
"""

from __future__ import annotations

import logging

from npu_inject.patching import PatchContext
from npu_inject.rehearsal_compute_dtype import cpu_probe, decide

TARGETS = (
    "torchtitan.trainer:Trainer.__init__",
)

logger = logging.getLogger("npu_inject")


def apply(ctx: PatchContext) -> None:
    choice = ctx.options["compute_dtype"]  # registry.json's option_rules: auto, float32 or keep
    probed: dict = {}

    def probe_once() -> tuple[bool, str, float, float]:
        if "figures" not in probed:
            probed["figures"] = cpu_probe()
        return probed["figures"]

    def use(training, configured: str, figures) -> None:
        dtype, message = decide(choice, configured, figures)
        training.mixed_precision_param = dtype
        (logger.warning if dtype != configured else logger.info)("npu_inject: %s", message)
        ctx.note(message)

    depth = [0]  # a trainer whose __init__ calls super().__init__() reaches this twice: decide once

    def trainer_init(original, trainer, config, *args, **kwargs):
        if depth[0]:
            return original(trainer, config, *args, **kwargs)
        depth[0] += 1
        try:
            return decided_init(original, trainer, config, *args, **kwargs)
        finally:
            depth[0] -= 1

    def decided_init(original, trainer, config, *args, **kwargs):
        training = config.training
        configured = training.mixed_precision_param
        if choice != "auto" or configured == "float32":
            use(training, configured, None)
            return original(trainer, config, *args, **kwargs)
        # FSDP reads the dtype after Trainer.init_distributed, where the runtime hands every rank
        # rank 0's figures: ranks deciding from their own timings could shard with different dtypes.
        agreed = []

        def use_rank0_figures(figures) -> None:
            use(training, configured, figures)
            agreed.append(figures)

        ctx.agree_with_rank0("bf16_probe", probe_once(), use_rank0_figures)
        result = original(trainer, config, *args, **kwargs)
        if not agreed:
            raise RuntimeError("rehearsal_dtype: Trainer.__init__ built the model without the runtime's rank "
                               "agreement (npu_inject.rank_agreement on Trainer.init_distributed) deciding "
                               f"the compute dtype; it kept {configured}. Set option compute_dtype=float32 "
                               "or keep to decide without it")
        return result

    ctx.wrap_overrides("Trainer.__init__", trainer_init)  # torchft's, flux's and the graph trainer's own
