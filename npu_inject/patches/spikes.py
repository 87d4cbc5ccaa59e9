"""A step whose gradient norm spikes far above its recent steps' does not touch the weights; its batch is skipped.

Off by default: ``TORCHTITAN_NPU_PATCHES=+spikes``. The patch takes part in the step
(:mod:`npu_inject.training_step`, before the optimizer) and judges the job's total gradient norm, which
``clip_grad_norm_`` returns before clipping and which is the same on every rank (FSDP, TP, EP and PP reduce
it), so every rank reaches the same verdict without a collective of its own. A bad batch, or a finite
corruption that throws the loss up, shows there before the update that would carry it into the weights.

The score is robust against the window of the last ``window`` applied steps' norms (registry option, default
20): the median and the median absolute deviation (scaled by 1.4826, so it estimates a standard deviation
for normal data). A step is a spike when its norm is above ``ratio`` times the median (default 3) and more
than ``threshold`` deviations above it (default 8); both, so that neither a quiet window (a deviation near
zero) nor a noisy one makes ordinary steps spikes. Nothing is judged before ``warmup`` applied steps
(default 10): the first steps' norms fall fast. A spike's update is kept out (as finite_steps keeps out a
non-finite one: parameters, optimizer state and learning rate stay those of the last applied step), the
step is logged on rank 0 and noted in the report, and its norm does not enter the window. After
``stop_after`` spikes in a row (default 3) every rank stops with one line: a run whose norms rose for good
is not a spike, and skipping would stall it.

Cost: nothing on the device; the norm's value is the one host read finite_steps already makes (the step's
owner reads it once per attempt for both), and a median of ``window`` floats per step on the host.
What it does not watch yet: the loss itself (a spike whose gradients stay small), a slow drift.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.training_step import Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")
REASON = "gradient norm spike"
MAD_TO_SIGMA = 1.4826  # the median absolute deviation of normal data times this is its standard deviation


def spike_verdict(value: float, window, ratio: float, threshold: float) -> str | None:
    """Why ``value`` is a spike against ``window`` (the recent applied norms), or None when it is not."""
    median = statistics.median(window)
    deviation = MAD_TO_SIGMA * statistics.median(abs(norm - median) for norm in window)
    if median <= 0 or value <= ratio * median:
        return None
    score = (value - median) / deviation if deviation > 0 else math.inf
    if score <= threshold:
        return None
    return (f"{REASON}: {value:.4g} is {value / median:.1f}x the median {median:.4g} of the last {len(window)} applied "
            f"steps, {score:.1f} deviations above it (ratio {ratio}, threshold {threshold})")


def apply(ctx: PatchContext) -> None:
    options = ctx.options  # registry.json's option_rules keep each in range
    if options["warmup"] > options["window"]:  # the window would never hold enough norms: nothing judged, silently
        stop_run(f"npu_inject spikes: registry option warmup={options['warmup']} is more than window="
                 f"{options['window']}: no step would ever be judged; set warmup <= window (patches['spikes'] "
                 "options in your TORCHTITAN_NPU_REGISTRY file)")
    window: deque[float] = deque(maxlen=options["window"])
    in_a_row: list[int] = []
    counts = {"spikes": 0}

    def before_optimizer(step: Step) -> None:
        value = step.grad_norm_value()
        if not math.isfinite(value):
            return  # finite_steps'
        if len(window) < options["warmup"]:
            return
        why = spike_verdict(value, window, options["ratio"], options["threshold"])
        if why is not None:
            step.skip_update(why)

    def after_step(step: Step) -> None:
        spike = next((reason for reason in step.skipped if reason.startswith(REASON)), None)
        if spike is None:
            # an applied step's norm (read once by the owner, before the optimizer) joins the window
            if not step.skipped and not step.discarded and step.grad_norm is not None:
                window.append(step.grad_norm_value())
                in_a_row.clear()
            return
        in_a_row.append(step.number)
        counts["spikes"] += 1
        line = (f"step {step.number}: {spike}; the update was not applied and the batch is skipped "
                f"({len(in_a_row)} in a row, {counts['spikes']} in all)")
        ctx.note(line)
        if int(os.environ.get("RANK", "0")) == 0:  # the same norm, so the same line, on every rank
            logger.warning("npu_inject spikes: %s", line)
        if len(in_a_row) >= options["stop_after"]:
            stop_run(f"npu_inject spikes: steps {', '.join(map(str, in_a_row))} in a row had a gradient norm spike "
                     f"(stop_after={options['stop_after']}): the norms rose for good, which skipping would only stall; "
                     "look at the data and the learning rate of those steps, or switch the check off "
                     "(TORCHTITAN_NPU_PATCHES=-spikes)")

    take_part(ctx, before_optimizer=before_optimizer, after_step=after_step)
