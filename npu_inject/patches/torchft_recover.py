"""A torchft collective aborted on an NPU: the device restarted, the communicators resumed, the step discarded.

Module ``torchtitan.experiments.torchft.trainer`` (``--module torchft.*`` with ``--fault_tolerance.enable``), npu
target; torch_npu 2.14's recovery calls; torchft_npu's HCCL group (which this requires).

A replica group that dies or hangs inside its step leaves its peers waiting in torchft's cross-group all-reduce.
Either torchft's timer (``--fault_tolerance.process_group_timeout_ms``) aborts the group, and on NPUs that abort
stops the device's tasks (torchft_npu): the hung collective and all work queued behind it end, and the training
thread's next operator, wherever it is (the gradient norm's read, torchft's ``should_commit``), fails with
torch_npu's "FORCE STOP". Or the collective fails by itself first (the peer's process ended, or its own timer
destroyed its communicator), and the next synchronisation reports the failed HCCL task. Without this patch the
process ends there and torchrun restarts the whole group.

Here a failed step of ``FaultTolerantTrainer.train_step`` (seen through the step's owner,
:mod:`npu_inject.training_step`, which discards the step once recovered) is recovered from either error: a "FORCE STOP" when torchft's group stopped the
device, or an error naming an HCCL call in a step that used torchft's group (then the group is aborted here,
which stops the device: the work queued behind the failed collective is dropped). It is not recovered when
torch_npu's task queue itself has ended ("The Inner error is reported as above": the process ends, as torch_npu
says), nor a UCE (uce_repair's). Then it does what torch_npu's step-level recovery does (MindSpeed's TTP):
``restart_device`` (the task queue runs again),
``reinit_process_group(rebuild_link=False)`` (HcclCommResume on every communicator of the job's process groups,
which the stop suspended), ``FSDPModule.reset_iter_state`` on each model part (FSDP as before the step). Then
the step is discarded as torchft discards any failed step: the error is reported to torchft, whose
``should_commit`` votes the step down on every rank of the replica group, the optimizer does not run, the
learning-rate schedule steps as upstream's does for a refused step, and the group trains on; its next quorum
leaves the failed group out. Logged, noted in the report; the step's metrics are not logged (its loss was
computed by work the stop dropped).

Why the weights are safe: the stop drops only work not done yet, and a step writes parameters and optimizer
states only in the optimizer, after ``should_commit``, which waits for the device first: a stop before the
optimizer began leaves them as the last committed step left them. A stop after this step's optimizer began
(torchft collectives inside the optimizer step, as LocalSGD's and DiLoCo's synchronisations, or the metrics'
all-reduce after the update) may have cut the update: the job stops with one line.

Every rank of the surviving group stops its own device when its own cross-group collective times out, so the
ranks drop the same work (all of it queued behind the hung all-reduce). A hang that reaches only some ranks of
the group is not recovered: the others wait in the group's own collectives until torchft_leave's watchdog ends
them, and torchrun restarts the group.
"""

from __future__ import annotations

import logging

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.step_recovery import FORCE_STOP, QUEUE_ENDED, UCE_MARK, fsdp_settings, names_hccl, reset_fsdp
from npu_inject.training_step import DISCARD, Step, take_part

TARGETS = (
    "torchtitan.experiments.torchft.trainer:FaultTolerantTrainer.train_step",
)

logger = logging.getLogger("npu_inject")


def torchft_group(trainer):
    """torchft's HCCL group of ``trainer`` (torchft_npu's), else None."""
    ft_manager = getattr(trainer, "ft_manager", None)
    if ft_manager is None or not ft_manager.enabled:
        return None
    group = getattr(ft_manager.manager, "_pg", None)
    return group if hasattr(group, "stopped_device") else None


def failure_of(group, text: str, issued_before: int) -> str | None:
    """Why the step's error is torchft's group's to recover from ("stopped", "failed"), or None."""
    if group is None or QUEUE_ENDED in text or UCE_MARK in text:
        return None
    if group.stopped_device is not None and FORCE_STOP in text:
        return "stopped"
    if group.issued > issued_before and names_hccl(text):
        return "failed"
    return None


def apply(ctx: PatchContext) -> None:
    import torch_npu
    from torch_npu.distributed import reinit_process_group

    def recover(trainer, group, step: int, kind: str, why: str):
        device = group.stopped_device
        if device is None:
            stop_run(f"npu_inject torchft_recover: step {step}: torchft's HCCL collective failed and its group "
                     f"was already aborted without stopping the device: nothing to restart ({why})")
        torch_npu.npu.restart_device(device)
        reinit_process_group(rebuild_link=False)  # HcclCommResume on every communicator of the job's groups
        reset_fsdp(trainer.model_parts, settings.get(id(trainer)))
        group.stopped_device = None
        manager = trainer.ft_manager.manager
        manager.report_error(RuntimeError(f"step {step}: torchft's HCCL group was aborted and NPU {device} stopped"))
        if manager.should_commit():
            stop_run(f"npu_inject torchft_recover: step {step}: torchft voted to commit a step whose device work "
                     "was dropped by stop_device; stopping rather than applying it")
        trainer.lr_schedulers.step()  # as upstream does for a step torchft refused
        what = "timed out" if kind == "stopped" else "failed"
        line = (f"step {step} discarded: torchft's cross-group collective {what}, NPU {device} was stopped and "
                f"restarted and the communicators resumed; the replica group trains on ({why})")
        logger.warning("npu_inject torchft_recover: %s", line)
        ctx.note(line)
        return DISCARD

    issued_before: dict[int, int] = {}  # the step's trainer (by id): its torchft group's collectives issued before
    settings: dict[int, list] = {}  # the step's trainer (by id): its FSDP settings as the step began

    def before_step(step: Step) -> None:
        group = torchft_group(step.trainer)
        issued_before[id(step.trainer)] = group.issued if group is not None else 0
        if group is not None:  # a step cut inside torchtitan's chunked loss leaves lm_head's switched (reset_fsdp)
            settings[id(step.trainer)] = fsdp_settings(step.trainer.model_parts)

    def on_failure(step: Step, error: Exception):
        group = torchft_group(step.trainer)
        if not isinstance(error, RuntimeError):
            return None
        kind = failure_of(group, str(error), issued_before.get(id(step.trainer), 0))
        if kind is None:
            return None
        why = " ".join(str(error).split())[:160]
        if step.update_began:
            stop_run(f"npu_inject torchft_recover: step {step.number}: torchft's HCCL collective failed or was stopped "
                     f"after the step's optimizer update began: the weights or optimizer states may hold part of it; "
                     f"resume from the last checkpoint ({why})")
        if kind == "failed":
            group.abort()  # stops the device: what was queued behind the failed collective is dropped
        return lambda: recover(step.trainer, group, step.number, kind, why)

    take_part(ctx, before_step=before_step, on_failure=on_failure)
