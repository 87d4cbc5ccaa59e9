"""What the patches that recover a failed step on an NPU share (uce_repair, step_repair, torchft_recover).

torch is imported by the functions only: the runtime core imports this module's names without it.
"""

from __future__ import annotations

UCE_MARK = "UCE ERROR"  # torch_npu's task queue (NPUQueue.cpp deviceErrorMap, RepoStatus::UCE_EXIT)
FORCE_STOP = "FORCE STOP"  # torch_npu's error for work ended by stop_device (ACL_ERROR_RT_DEVICE_TASK_ABORT 107022)
QUEUE_ENDED = "The Inner error is reported as above"  # torch_npu's task queue thread has exited
TEMPORARY = 2  # check_uce_in_memory: the error lies in memory given back once the step's tensors are freed
WHERE = {0: "no memory error recorded by torch_npu", 1: "memory outside torch_npu's pool",
         3: "memory holding the job's state (weights, gradients or optimizer states)"}


def names_hccl(text: str) -> bool:
    """Whether an error's text names an HCCL call (a failed or cut collective)."""
    return "Hccl" in text or "HCCL" in text


# What a step may switch on an FSDP parameter group and back: torchtitan's chunked loss turns lm_head's resharding
# after forward and backward and its gradient sync off for its chunks and on again after the last
# (components/loss.py), fully_shard's set_reshard_after_forward/backward and set_requires_gradient_sync.
_GROUP_SETTINGS = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads")


def _fsdp_states(model_parts):
    """The FSDP state of every FSDP module of ``model_parts``."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                yield module._get_fsdp_state()


def _fsdp_params(model_parts):
    for state in _fsdp_states(model_parts):
        for group in state._fsdp_param_groups:
            yield from group.fsdp_params


def fsdp_settings(model_parts) -> list[tuple]:
    """Each FSDP module's settings a step may change, as they are now (a step's start), for :func:`reset_fsdp`."""
    taken = []
    for state in _fsdp_states(model_parts):
        groups = [(group, {name: getattr(group, name) for name in _GROUP_SETTINGS if hasattr(group, name)})
                  for group in state._fsdp_param_groups]
        taken.append((state, state._auto_reshard_after_forward, groups))
    return taken


def reset_fsdp(model_parts, settings: list[tuple] | None = None) -> None:
    """FSDP as before a step that failed midway: the modules' ``settings`` as the step began (:func:`fsdp_settings`;
    a step cut inside torchtitan's chunked loss leaves lm_head not resharding after forward, and the retry's
    forward then skipped its all-gather on those ranks alone: the ranks' FSDP collectives disagreed), then
    ``FSDPModule.reset_iter_state()`` (torch 2.14's recovery call) on each model part's root FSDP module: it waits
    for FSDP's collectives, reshards every parameter group and clears the failed step's trackers; last, the
    gradients the failed step's backwards left unreduced are dropped (below)."""
    from torch.distributed.fsdp import FSDPModule

    for state, auto, groups in settings or ():
        state._auto_reshard_after_forward = auto
        for group, values in groups:
            for name, value in values.items():
                setattr(group, name, value)
    for part in model_parts:
        root = next((module for module in part.modules() if isinstance(module, FSDPModule)), None)
        if root is not None:
            root.reset_iter_state()
    # reset_iter_state keeps the gradients a backward left unreduced (torch 2.14 clears HSDP's partial reduction,
    # not these): a pipeline schedule's backwards before its last run without gradient sync, so a step cut after
    # one of them had the retry add that microbatch's gradients twice (PP 2: step 3's gradient norm 1.7871 against
    # 1.7296, every later loss off). None at a step's start under torchtitan (unsynced_gradients), so all are the
    # failed attempt's.
    for fsdp_param in _fsdp_params(model_parts):
        fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


def unsynced_gradients(model_parts) -> int:
    """FSDP parameters holding a gradient not yet reduced (a backward run without gradient sync). At a step's start
    torchtitan leaves none: a job that carries some across steps cannot have a failed attempt's part told apart."""
    count = 0
    for fsdp_param in _fsdp_params(model_parts):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if fsdp_param.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None):
            count += 1
    return count


def reset_pipeline(trainer) -> None:
    """A pipeline schedule as before a step that failed midway: each stage's runtime state (the microbatches'
    activations and gradients kept between actions) cleared, and the losses the schedule had gathered of the
    failed step dropped (torch clears those only when a step completes)."""
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None:
        return
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        if stage is not None:
            stage.clear_runtime_states()
    losses = getattr(schedule, "_internal_losses", None)
    if isinstance(losses, list):
        losses.clear()


def npu_backends() -> list:
    """torch_npu's HCCL backend of every process group of the job."""
    import torch
    from torch.distributed import distributed_c10d

    npu = torch.device("npu")
    return [group._get_backend(npu) for group in list(distributed_c10d._pg_map) if npu in group._device_types]


def pause_watchdogs() -> None:
    """Every HCCL watchdog of the job told to skip its checks, as ``torch_npu.npu.stop_device`` does, but before the
    device is stopped: stop_device stops the device first and tells the watchdogs after, so one that looks in
    between finds the stopped collective failed and, with its teardown on (torch_npu's default), ends the process.
    The watchdog reads the status as each of its passes begins (torch_npu's workCleanupLoop); a pass already under
    way still looks once more."""
    from torch_npu.npu._recovery import WATCHDOG_STATUS_STOP

    for backend in npu_backends():
        backend.set_watchdog_status(WATCHDOG_STATUS_STOP)


def drop_hccl_comms(reason: str) -> int:
    """Destroy every HCCL communicator of the job's process groups (torch_npu makes new ones at each group's next
    collective) and delete the store keys they were made through, so that no rank's new communicator reads a
    stale one; every rank must do this before any rank's next collective. Returns the groups dropped.

    Destroyed rather than resumed: a communicator a call was cut in or failed on carries the failure (the CANN
    emulation refuses to resume one; whether real HCCL resumes one after a link error is not documented)."""
    backends = npu_backends()
    for backend in backends:
        backend._delete_tcpstore_key()
        backend.abort_hccl_comm(reason)
    return len(backends)
