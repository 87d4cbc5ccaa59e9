"""A step whose gradients are not finite does not touch the weights; too many in a row stop the job in one line.

Module ``torchtitan.trainer``: ``Trainer.train_step`` clips the gradients
(``dist_utils.clip_grad_norm_``, which returns the job's total gradient norm, the same on every
rank: FSDP, TP, EP and PP reduce it) and then calls ``self.optimizers.step()`` and
``self.lr_schedulers.step()`` whatever the norm is. A NaN or inf anywhere (a bad batch, an overflow, a
device fault) is then written into every parameter and both Adam moments, and only on a logging step
does torchtitan notice the loss, after the update ("Loss is not finite ... Stopping training"). Upstream
main stops such steps before the optimizer since its PR #4226; the supported release does not.

This patch takes part in the step (:mod:`npu_inject.training_step`, before the optimizer): when the total
gradient norm is not finite, this step's update is kept out (``Step.skip_update``: ``optimizers.step`` and
``lr_schedulers.step`` do nothing, their hooks, MoE's expert-bias update among them, do not run), so
parameters, optimizer state and the learning-rate schedule stay exactly those of the last applied step. With
torchft committing every step, the error is reported to torchft instead, whose ``should_commit`` then refuses
the step on the whole replica group. The
skipped step is logged on rank 0 and noted in the report; torchtitan's own "Loss is not finite" stop
for that step is the skip it already handled and is not raised. After ``stop_after`` such steps in a
row (registry option, default 3) every rank stops with one line naming the steps and the last step
that was applied. A NaN loss yields NaN gradients, so the norm sees it; a non-finite loss whose
gradients are all finite (a loss detached from the graph) is not caught here.

Cost: reading the norm's finiteness is one device-to-host copy of one element per step, after the
backward and before the optimizer (torchtitan already reads the loss on logging steps). Nothing of this
runs under torch.compile (torchtitan compiles the model, not the optimizer step).
"""

from __future__ import annotations

import logging
import math
import os

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.training_step import DISCARD, Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")
UPSTREAM_NONFINITE_STOP = "Loss is not finite"  # torchtitan 0.3.0 trainer.py, raised after the update
REASON = "gradient norm not finite"


def apply(ctx: PatchContext) -> None:
    stop_after = ctx.options["stop_after"]  # registry.json's option_rules keep it >= 1
    in_a_row: list[int] = []
    counts = {"skipped": 0, "last_applied": None}  # last_applied: set at the first step (a resumed job starts past 1)

    def before_step(step: Step) -> None:
        if counts["last_applied"] is None:
            counts["last_applied"] = step.number - 1

    def before_optimizer(step: Step) -> None:
        value = step.grad_norm_value()
        if not math.isfinite(value):
            step.skip_update(f"{REASON} ({value})")

    def on_failure(step: Step, error: Exception):
        # upstream's check of the loss whose update this patch already kept out
        if any(reason.startswith(REASON) for reason in step.skipped) and str(error).startswith(UPSTREAM_NONFINITE_STOP):
            return lambda: DISCARD
        return None

    def after_step(step: Step) -> None:
        if not any(reason.startswith(REASON) for reason in step.skipped):
            if not step.skipped and not step.discarded:
                in_a_row.clear()
                counts["last_applied"] = step.number
            return
        in_a_row.append(step.number)
        counts["skipped"] += 1
        line = (f"step {step.number}: gradient norm not finite, the update was not applied (parameters, optimizer "
                f"state and learning rate kept from step {counts['last_applied']}); {len(in_a_row)} in a row, "
                f"{counts['skipped']} in all")
        ctx.note(line)
        if int(os.environ.get("RANK", "0")) == 0:  # the same norm, so the same line, on every rank
            logger.warning("npu_inject finite_steps: %s", line)
        if len(in_a_row) >= stop_after:
            stop_run(f"npu_inject finite_steps: steps {', '.join(map(str, in_a_row))} in a row had a "
                     f"non-finite gradient norm (stop_after={stop_after}); the weights are those of step "
                     f"{counts['last_applied']}, the last applied. Look at the data and the learning rate of those "
                     "steps, or resume from a checkpoint at or before that step")

    take_part(ctx, before_step=before_step, before_optimizer=before_optimizer, on_failure=on_failure,
              after_step=after_step)
