"""A step whose gradients are not finite does not touch the weights; too many in a row stop the job in one line.

Module ``torchtitan.trainer``: ``Trainer.train_step`` clips the gradients
(``dist_utils.clip_grad_norm_``, which returns the job's total gradient norm, the same on every
rank: FSDP, TP, EP and PP reduce it) and then calls ``self.optimizers.step()`` and
``self.lr_schedulers.step()`` whatever the norm is. A NaN or inf anywhere (a bad batch, an overflow, a
device fault) is then written into every parameter and both Adam moments, and only on a logging step
does torchtitan notice the loss, after the update ("Loss is not finite ... Stopping training"). Upstream
main stops such steps before the optimizer since its PR #4226; the supported release does not.

This patch wraps ``Trainer.train_step`` (and the overrides of torchft's, flux's and the graph
trainer's) and the ``clip_grad_norm_`` it calls: when the returned norm is not finite, this step's
``optimizers.step`` and ``lr_schedulers.step`` do nothing (the optimizer's pre- and post-step hooks,
MoE's expert-bias update among them, do not run either), so parameters, optimizer state and the
learning-rate schedule stay exactly those of the last applied step. With torchft committing every
step, the error is reported to torchft instead, whose ``should_commit`` then refuses the step on the
whole replica group. The
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

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
    "torchtitan.distributed.utils:clip_grad_norm_",
)

logger = logging.getLogger("npu_inject")
UPSTREAM_NONFINITE_STOP = "Loss is not finite"  # torchtitan 0.3.0 trainer.py, raised after the update


class StepGuard:
    """The state of one process's guard: the step being trained and the non-finite steps so far."""

    def __init__(self, stop_after: int) -> None:
        self.stop_after = stop_after
        self.trainer = None  # the Trainer whose train_step is running, else None (the planner, tools)
        self.skipped_this_step = False
        self.in_a_row: list[int] = []
        self.skipped_in_all = 0
        self.shadowed: list[tuple[object, object]] = []  # (owner, its own instance step or _NOT_SET)
        self.last_applied: int | None = None  # set at the first step (a resumed job starts past 1)

    def check(self, total_norm) -> None:
        """Called with the step's total gradient norm before the optimizer runs."""
        if self.trainer is None:
            return
        value = float(total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm)
        if math.isfinite(value):
            return
        step = self.trainer.step
        self.skipped_this_step = True
        self.in_a_row.append(step)
        self.skipped_in_all += 1
        # Instance attributes shadow the methods for this step only (train_step's wrapper puts them back),
        # so the optimizers' own step machinery, hooks included, is not entered.
        ft = getattr(self.trainer, "ft_manager", None)
        if getattr(ft, "enabled", False) and getattr(ft, "use_async_quorum", False):
            # torchft commits each step: its optimizer wrapper must still ask should_commit, which an error
            # reported here makes false on the whole replica group, so no replica applies the step.
            ft.manager.report_error(FloatingPointError(f"gradient norm {value} at step {step} (npu_inject finite_steps)"))
        else:
            self._shadow(self.trainer.optimizers)
        self._shadow(self.trainer.lr_schedulers)

    def _shadow(self, owner) -> None:
        """``owner.step`` does nothing until :meth:`unshadow`; an instance ``step`` already there (another
        tool's wrapper) is kept aside and put back."""
        self.shadowed.append((owner, vars(owner).get("step", _NOT_SET)))
        owner.step = _no_step

    def unshadow(self) -> None:
        for owner, previous in reversed(self.shadowed):
            if previous is _NOT_SET:
                del owner.step
            else:
                owner.step = previous
        self.shadowed.clear()


_NOT_SET = object()


def _no_step(*args, **kwargs) -> None:
    return None


def apply(ctx: PatchContext) -> None:
    stop_after = ctx.options["stop_after"]  # registry.json's option_rules keep it >= 1
    guard = StepGuard(stop_after)

    def clip_grad_norm_(original, *args, **kwargs):
        total_norm = original(*args, **kwargs)
        guard.check(total_norm)
        return total_norm

    def train_step(original, trainer, *args, **kwargs):
        if guard.trainer is not None:  # an override calling super().train_step(): the outer call decides
            return original(trainer, *args, **kwargs)
        guard.trainer, guard.skipped_this_step = trainer, False
        if guard.last_applied is None:
            guard.last_applied = trainer.step - 1
        try:
            result = original(trainer, *args, **kwargs)
        except RuntimeError as exc:
            if not (guard.skipped_this_step and str(exc).startswith(UPSTREAM_NONFINITE_STOP)):
                raise
            result = None  # upstream's check of the loss whose update this guard already kept out
        finally:
            guard.trainer = None
            guard.unshadow()
        if guard.skipped_this_step:
            _skipped(trainer.step)
        else:
            guard.in_a_row.clear()
            guard.last_applied = trainer.step
        return result

    def _skipped(step: int) -> None:
        line = (f"step {step}: gradient norm not finite, the update was not applied (parameters, optimizer "
                f"state and learning rate kept from step {guard.last_applied}); {len(guard.in_a_row)} in a row, "
                f"{guard.skipped_in_all} in all")
        ctx.note(line)
        if int(os.environ.get("RANK", "0")) == 0:  # the same norm, so the same line, on every rank
            logger.warning("npu_inject finite_steps: %s", line)
        if len(guard.in_a_row) >= guard.stop_after:
            stop_run(f"npu_inject finite_steps: steps {', '.join(map(str, guard.in_a_row))} in a row had a "
                     f"non-finite gradient norm (stop_after={guard.stop_after}); the weights are those of step "
                     f"{guard.last_applied}, the last applied. Look at the data and the learning rate of those "
                     "steps, or resume from a checkpoint at or before that step")

    ctx.wrap("clip_grad_norm_", clip_grad_norm_)
    # torchft's, flux's and the graph trainer's train_step override the base one
    ctx.wrap_overrides("Trainer.train_step", train_step)
