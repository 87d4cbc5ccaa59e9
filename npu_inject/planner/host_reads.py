"""Where a training step reads a device value on the host: the points the planner marks in a recording.

At a host read (``.item()``, ``.tolist()``, a blocking device-to-host copy, a device synchronisation) the host
waits until the device has run everything issued, and the device then idles until the host has issued what
follows: the plan's "host waits" term (:func:`npu_inject.planner.costmodel.simulate`). The recording runs the
rehearsal target on fake tensors, which read nothing back, so the planner marks each read where the NPU job makes
it:

* torchtitan's own (0.3's ``Trainer.train_step``): the batch's host-to-device copies (the valid-token count as the
  step begins; each microbatch group's inputs and labels as the group begins: torch_npu copies pageable host
  memory synchronously, after the stream has drained, as CUDA does), the MoE all-to-all dispatcher's split sizes
  (one per MoE layer's forward and recomputation, marked by :mod:`npu_inject.planner.interventions`), and on
  logging steps (``--metrics.log_freq``) the token count, the loss (with data or context parallelism: the
  tokens seen copied to the device, then three all-reduced values read back; one loss read without) and the
  gradient norm, after the optimizer.
* this runtime's patches that run in the NPU job (:data:`RUNTIME_READS`), as the user's selection
  (``TORCHTITAN_NPU_PATCHES``, with which the planner's workers start) and the registry's defaults turn them on.

The CANN emulation counts every host synchronisation of a step by its Python caller (``npu-inject audit``);
``python tools/bench_plan.py syncs`` holds these marks against those counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

STEP_START, BEFORE_OPTIMIZER = "step start", "before the optimizer"


@dataclass(frozen=True)
class RuntimeRead:
    patch: str  # the registry id whose code reads
    where: str  # STEP_START or BEFORE_OPTIMIZER
    what: str
    several_ranks: bool = False  # only in a job of several ranks without torchft (step_repair's condition)

    @property
    def site(self) -> str:
        return f"{self.patch}: {self.what}"


# step_repair: a fault of the last step's tail is met before this step's work (step start), one of the forward or
# backward while the step can still be retried (before the update); finite_steps: one copy of the gradient norm per
# attempt, other patches' values riding along in it (npu_inject/training_step.py).
RUNTIME_READS = (
    RuntimeRead("step_repair", STEP_START, "device sync at step start", several_ranks=True),
    RuntimeRead("finite_steps", BEFORE_OPTIMIZER, "gradient norm"),
    RuntimeRead("step_repair", BEFORE_OPTIMIZER, "device sync before the update", several_ranks=True),
)

TOKEN_COUNT_COPY = "torchtitan: valid-token count to device"
BATCH_COPY = "torchtitan: batch tensor to device"
MOE_SPLITS = "torchtitan: MoE all-to-all split sizes"
TOKENS_SEEN_COPY = "torchtitan: tokens seen to device (logging)"
LOGGED_TOKENS = "torchtitan: token count (logging)"
LOGGED_LOSS = "torchtitan: loss (logging)"
LOGGED_NORM = "torchtitan: gradient norm (logging)"


def runtime_reads(enabled: Mapping[str, bool], world_size: int, torchft: bool) -> list[RuntimeRead]:
    """The runtime's reads an NPU job makes with these patches on (``enabled``: the selection applied over the
    registry's defaults, as the recording's runtime has it)."""
    return [read for read in RUNTIME_READS if enabled.get(read.patch)
            and not (read.several_ranks and (world_size < 2 or torchft))]


def logged_reads(data_parallel_or_cp: bool) -> list[str]:
    """torchtitan 0.3's reads on a logging step, in its order (Trainer.train_step): ``int(global_valid_tokens)``,
    the loss (``dist_sum``, ``dist_max`` and the tokens seen, each ``.item()``, with data or context parallelism;
    ``accumulated_loss.item()`` without), ``grad_norm.item()``."""
    if data_parallel_or_cp:
        return [LOGGED_TOKENS, TOKENS_SEEN_COPY, *[LOGGED_LOSS] * 3, LOGGED_NORM]
    return [LOGGED_TOKENS, LOGGED_LOSS, LOGGED_NORM]
