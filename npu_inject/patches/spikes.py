"""A step whose loss or gradient norm spikes far above its recent steps' is not applied; its batch is skipped.

Off by default: ``TORCHTITAN_NPU_PATCHES=+spikes``. The patch takes part in the step
(:mod:`npu_inject.training_step`, before the optimizer) and judges two of the job's values, the same on every
rank, so every rank reaches the same verdict:

* the total gradient norm, which ``clip_grad_norm_`` returns before clipping (FSDP, TP, EP and PP reduce it);
* the step's loss, torchtitan's logged ``loss`` (the sum over the loss mesh of each rank's share; with PP only
  the last stage has one). The patch keeps each microbatch's detached loss from ``forward_backward_step`` and,
  as soon as the gradients are clipped, sums every rank's share with one ``all_reduce`` of two floats over the
  world: each holder of a loss adds it and counts itself, and the sum times the loss mesh's size over the count
  is the loss (a holder's share appears once per tensor-parallel rank). It catches a batch that throws the loss
  up while the clipped-away gradients stay small. With torchft committing every step (gradients averaged
  across the replica groups, ``should_commit`` answering for one group), the groups' losses are averaged
  through torchft's all-reduce too, so every group reaches the same verdict.

Option ``watch`` ("both", "grad_norm" or "loss") chooses. A bad batch, or a finite corruption that throws the
loss up, shows there before the update that would carry it into the weights.

The score is robust against the window of the last ``window`` applied steps' values (registry option, default
20): the median and the median absolute deviation (scaled by 1.4826, so it estimates a standard deviation
for normal data). A value is a spike when it is above a ratio times the median (``ratio``, default 10, for the
norm; ``loss_ratio``, default 1.5, for the loss, whose spikes are smaller multiples) and more than
``threshold`` deviations above it (default 8); both, so that neither a quiet window (a deviation near zero)
nor a noisy one makes ordinary steps spikes. The norm's ratio is measured: deepseek_v3 debug's 300 faultless
steps on the rehearsal (tools/bench_quiet_checks.py) jump to 5.9 times the window's median (step 18) and 4.5
times (step 169, 27 deviations), which a ratio of 3 skipped; an injected ``loss_spike`` is 92 times. Nothing
is judged before ``warmup`` applied steps (default 10): the first steps' values fall fast. A spike's update is kept out (as finite_steps keeps out a non-finite one:
parameters, optimizer state and learning rate stay those of the last applied step), the step is logged on
rank 0 and noted in the report, and its values do not enter the windows. After ``stop_after`` spikes in a row
(default 3) every rank stops with one line: a run whose values rose for good is not a spike, and skipping
would stall it.

Cost: on the device, with the loss watched, one ``all_reduce`` of two floats per step; no more host reads:
the loss comes back in the one copy that reads the norm (the step's owner reads it once per attempt for
finite_steps and this patch); a median of ``window`` floats per value and step on the host.
What it does not watch: a slow drift; a spike of one rank's share that the loss mesh's sum hides.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque

from npu_inject import training_step
from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.training_step import Step, commits_every_step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")
REASON = "spike"  # every verdict's reason ends its name with it: "gradient norm spike", "loss spike"
WATCHED = {"grad_norm": "gradient norm", "loss": "loss"}
MAD_TO_SIGMA = 1.4826  # the median absolute deviation of normal data times this is its standard deviation


def spike_verdict(value: float, window, ratio: float, threshold: float, what: str = "gradient norm") -> str | None:
    """Why ``value`` (a ``what``) is a spike against ``window`` (the recent applied values), or None when it is not."""
    median = statistics.median(window)
    deviation = MAD_TO_SIGMA * statistics.median(abs(norm - median) for norm in window)
    if median <= 0 or value <= ratio * median:
        return None
    score = (value - median) / deviation if deviation > 0 else math.inf
    if score <= threshold:
        return None
    return (f"{what} {REASON}: {value:.4g} is {value / median:.1f}x the median {median:.4g} of the last {len(window)} applied "
            f"steps, {score:.1f} deviations above it (ratio {ratio}, threshold {threshold})")


def loss_of_the_step(shares, holds_loss: bool, loss_mesh_size: int, device):
    """The job's loss of one step as a 0-dim device tensor, from this rank's microbatch ``shares``: every rank
    takes part in the one ``all_reduce`` (of [sum of its shares if it ``holds_loss`` else 0, 1 or 0])."""
    import torch
    import torch.distributed as dist

    share = torch.stack([each.reshape(()).float() for each in shares]).sum() if holds_loss and shares else None
    if holds_loss and share is None:
        raise RuntimeError("npu_inject spikes: this rank holds the loss but forward_backward_step returned none "
                           "this attempt (npu_inject/patches/spikes.py); switch the loss watch off with "
                           "option watch='grad_norm'")
    # made on the device (a fill, not torch.tensor(x, device=...): a host-to-device copy and a stream sync on NPUs)
    count = torch.ones((), device=device) if holds_loss else torch.zeros((), device=device)
    summed = torch.stack([share.to(device) if share is not None else torch.zeros((), device=device), count])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(summed)
    return summed[0] * loss_mesh_size / summed[1]


def apply(ctx: PatchContext) -> None:
    options = ctx.options  # registry.json's option_rules keep each in range
    if options["warmup"] > options["window"]:  # the window would never hold enough values: nothing judged, silently
        stop_run(f"npu_inject spikes: registry option warmup={options['warmup']} is more than window="
                 f"{options['window']}: no step would ever be judged; set warmup <= window (patches['spikes'] "
                 "options in your TORCHTITAN_NPU_REGISTRY file)")
    watched = ("grad_norm", "loss") if options["watch"] == "both" else (options["watch"],)
    windows = {name: deque(maxlen=options["window"]) for name in watched}
    ratios = {"grad_norm": options["ratio"], "loss": options["loss_ratio"]}
    in_a_row: list[int] = []
    counts = {"spikes": 0}
    owner = training_step.OWNER

    def before_step(step: Step) -> None:
        if "loss" not in windows:
            return
        trainer = step.trainer
        shares: list[tuple[int, object]] = []  # (attempt, detached loss) of each forward_backward_step call
        forward_backward = trainer.forward_backward_step

        def kept(*args, **kwargs):
            loss = forward_backward(*args, **kwargs)
            if not owner.retraining:  # a rollback's steps inside this one are not this step's
                shares.append((step.attempt, loss.detach()))
            return loss

        # this step only: an instance attribute over the method (another tool's, already there, is put back)
        previous = vars(trainer).get("forward_backward_step")
        trainer.forward_backward_step = kept
        step.on_exit(lambda: setattr(trainer, "forward_backward_step", previous) if previous is not None
                     else vars(trainer).pop("forward_backward_step", None))
        dims = trainer.parallel_dims
        holds_loss = not dims.pp_enabled or trainer.pp_has_last_stage
        loss_mesh = dims.get_optional_mesh("loss") if dims.dp_cp_enabled else None
        loss_mesh_size = loss_mesh.size() if loss_mesh is not None else 1
        across_groups = commits_every_step(trainer)

        def make():
            loss = loss_of_the_step([loss for attempt, loss in shares if attempt == step.attempt], holds_loss,
                                    loss_mesh_size, trainer.device)
            if not across_groups:
                return loss
            # torchft committing every step: every group judges the groups' average loss, as it applies their
            # averaged gradients
            averaged = loss.reshape(1).clone()
            trainer.ft_manager.manager.allreduce(averaged).wait()
            return averaged[0]

        step.read_along("loss", make)

    def values(step: Step) -> dict[str, float]:
        return {name: step.grad_norm_value() if name == "grad_norm" else step.value_read(name) for name in watched}

    def before_optimizer(step: Step) -> None:
        now = values(step)
        if not all(math.isfinite(value) for value in now.values()):
            if "loss" in now and not math.isfinite(now["loss"]) and math.isfinite(step.grad_norm_value()):
                # finite gradients of a non-finite loss: no rank held one (0 / 0), so the watch sees nothing
                stop_run(f"npu_inject spikes: step {step.number}: the loss summed over the ranks is {now['loss']} "
                         f"while the gradient norm is {step.grad_norm_value():.4g}: no rank returned its loss from "
                         "forward_backward_step to the loss watch (npu_inject/patches/spikes.py); switch it off with "
                         "option watch='grad_norm'")
            return  # finite_steps'
        if any(len(window) < options["warmup"] for window in windows.values()):
            return
        why = [verdict for name, value in now.items() if (verdict := spike_verdict(
            value, windows[name], ratios[name], options["threshold"], WATCHED[name])) is not None]
        if why:
            step.skip_update("; ".join(why))

    def after_step(step: Step) -> None:
        spike = next((reason for reason in step.skipped if REASON + ":" in reason), None)
        if spike is None:
            # an applied step's values (read once by the owner, before the optimizer) join the windows
            if not step.skipped and not step.discarded and step.grad_norm is not None:
                for name, value in values(step).items():
                    windows[name].append(value)
                in_a_row.clear()
            return
        in_a_row.append(step.number)
        counts["spikes"] += 1
        line = (f"step {step.number}: {spike}; the update was not applied and the batch is skipped "
                f"({len(in_a_row)} in a row, {counts['spikes']} in all)")
        ctx.note(line)
        if int(os.environ.get("RANK", "0")) == 0:  # the same values, so the same line, on every rank
            logger.warning("npu_inject spikes: %s", line)
        if len(in_a_row) >= options["stop_after"]:
            stop_run(f"npu_inject spikes: steps {', '.join(map(str, in_a_row))} in a row had a spike "
                     f"(stop_after={options['stop_after']}): the values rose for good, which skipping would only "
                     "stall; look at the data and the learning rate of those steps, or switch the check off "
                     "(TORCHTITAN_NPU_PATCHES=-spikes)")

    take_part(ctx, before_step=before_step, before_optimizer=before_optimizer, after_step=after_step)
