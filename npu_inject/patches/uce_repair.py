"""A device memory error (UCE) in temporary memory is repaired and the step trained again; elsewhere it stops in one line.

Module ``torchtitan.trainer``: the patch takes part in ``Trainer.train_step`` (:mod:`npu_inject.training_step`:
before the step, and on its failure, where a repaired step is retried on the batches the owner kept). NPU
target only; torch_npu 2.14's recovery calls.

An HBM uncorrectable error met by a kernel makes torch_npu stop its task queue: the next operator raises
``RuntimeError("UCE ERROR, ...")`` and torchtitan's job ends. torch_npu records which memory was hit
(``aclrtGetMemUceInfo``) and ``torch_npu.npu.check_uce_in_memory(device)`` says where it lies: 2, memory that
only held the step's temporaries (activations, workspaces: free once the step's tensors are, given back by
the allocator's cache); 3, memory that holds the job's state (weights, gradients, optimizer states); 1,
memory outside torch_npu's pool; 0, no error recorded. For 2 this patch does what MindSpeed's step-level
repair does: ``torch_npu.npu.restart_device(device)`` (repairs the memory where CANN can, resumes the task
queue) and the step runs again from its start on the same batches, which the step's owner kept as the data
iterator gave them. The step's optimizer update had not run (the error stopped the step before it), so the
job's state is that of the last step and the retried step trains exactly as the failed one would have.
Each repair is noted in the report; a second UCE in the same step, or 0, 1 or 3, stops the job with one
line saying which (3: resume from the last checkpoint, or heal from a torchft replica group).

Three things would make a retried step wrong; the patch handles each. torch_npu drops every task queued
after the failed one, so a UCE met before the previous step's update had run would drop part of that update
and be reported in this step: the patch waits for the device before each step (one synchronisation per
step; with synchronous launches it has nothing left to wait for), and a UCE reported there stops the job. A
UCE reported after this step's optimizer began (``torch.optim``'s step pre-hook) may follow part of the
update: it stops too. And the failed forward or backward leaves FSDP mid-step: parameter groups unsharded
(the module's parameters are then the all-gather buffers, freed and reused), trackers of the step that
failed. ``FSDPModule.reset_iter_state()`` (torch 2.14's recovery call, on each model part's root FSDP
module) waits for FSDP's collectives, reshards every group and clears the trackers before the retry.
Without it, a retry with torch_npu's task queue on (its default) began, on the CANN emulation, with layer
0's parameters reading other tensors' memory (step 3's loss 7.69 where 7.61526 is right), or stopped in
FSDP's "Expects to be in one of (SHARDED, SHARDED_POST_FORWARD), not UNSHARDED": the queue reports the
error at a later operator, after FSDP had unsharded the group, where a synchronous launch reports it at the
failed operator itself (which is why only synchronous launches had retried correctly before).

A job of several ranks needs every rank to stop and retry the step together (a rank that repairs alone meets
its peers in different collectives): that is :mod:`npu_inject.patches.step_repair`'s, which this patch leaves
such a UCE to; with step_repair switched off, the rank stops with one line.
"""

from __future__ import annotations

import gc
import logging
import os

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.step_recovery import TEMPORARY, UCE_MARK, WHERE, reset_fsdp
from npu_inject.training_step import OWNER, RETRY, Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")


def apply(ctx: PatchContext) -> None:
    import torch
    import torch_npu

    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    def stop_in_update(step: int, when: str, error) -> None:
        stop_run(f"npu_inject uce_repair: step {step}: a device memory error (UCE) reported {when}: the weights or "
                 "optimizer states may hold part of its update; resume from the last checkpoint "
                 f"({str(error).splitlines()[0]})")

    def before_step(step: Step) -> None:
        try:
            if world_size == 1:  # the previous step's work has run: a UCE from here on is this step's
                torch.accelerator.synchronize()
        except RuntimeError as exc:
            if UCE_MARK not in str(exc):
                raise
            stop_in_update(step.number - 1, "after the step's optimizer update was issued", exc)

    def on_failure(step: Step, error: Exception):
        if not isinstance(error, RuntimeError) or UCE_MARK not in str(error):
            return None
        torchft = getattr(getattr(step.trainer, "ft_manager", None), "enabled", False)
        if world_size > 1 and not torchft and "step_repair" in OWNER.phase_order()["on_failure"]:
            return None  # every rank repairs and retries together
        first_line = str(error).splitlines()[0]
        if step.attempt > 0:
            stop_run(f"npu_inject uce_repair: step {step.number}: a second device memory error (UCE) in the same step "
                     f"after a repair: the device is failing; resume from the last checkpoint on another ({first_line})")
        if step.update_began:
            stop_in_update(step.number, "after the step's optimizer began", first_line)
        return lambda: repair(step, first_line)

    def repair(step: Step, first_line: str):
        gc.collect()
        number, device = step.number, step.trainer.device.index or 0
        where = torch_npu.npu.check_uce_in_memory(device)
        if where != TEMPORARY:
            stop_run(f"npu_inject uce_repair: step {number}: a device memory error (UCE) in "
                     f"{WHERE.get(where, f'memory of kind {where}')}: not repairable in the job; resume from the last "
                     f"checkpoint, or heal from a torchft replica group ({first_line})")
        if world_size > 1:
            stop_run(f"npu_inject uce_repair: step {number}: a device memory error (UCE) in temporary memory on rank "
                     f"{os.environ.get('RANK', '0')} of {world_size}: retrying the step needs every rank to stop and "
                     "retry together, which is step_repair's (switched off); resume from the last checkpoint")
        torch_npu.npu.restart_device(device)
        reset_fsdp(step.trainer.model_parts)  # FSDP as it was before the step: sharded, no trackers of the failed one
        ctx.note(f"step {number}: device memory error (UCE) in temporary memory repaired "
                 "(torch_npu restart_device), step trained again on the same batches")
        logger.warning("npu_inject uce_repair: step %d: device memory error in temporary memory: repaired, "
                       "training the step again", number)
        return RETRY

    take_part(ctx, before_step=before_step, on_failure=on_failure)
