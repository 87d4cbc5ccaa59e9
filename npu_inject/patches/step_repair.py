"""One NPU's device fault repaired inside a job of several ranks: every rank stops, repairs and retries the step.

Module ``torchtitan.trainer``: the patch takes part in ``Trainer.train_step`` (:mod:`npu_inject.training_step`:
before the step, before its optimizer, after it, and on its failure, where the step is retried on the batches the
owner kept). NPU target, torch_npu 2.14's recovery calls; a job of one rank is uce_repair's, a torchft job's
failures torchft_recover's (both said in the report).

The faults repaired: a device memory error (UCE) in memory of the step's temporaries (``check_uce_in_memory`` 2,
as uce_repair does for one rank), an HCCL collective that fails (a flapping link, a NIC reset: the error names an
HCCL call), and a collective that never completes (stuck on the device: the step outlives ``stuck_after``
seconds, counted from the process's second step; unset, torchtitan's ``--comm.train_timeout_seconds`` where
torch_npu's watchdog does not tear down, else none: the watchdog's own timeout and dumps handle a hang). The
rank that meets one publishes it in torchrun's store (:mod:`npu_inject.repair_channel`), whose watcher thread on
every rank stops its device (``torch_npu.npu.stop_device``, its HCCL watchdogs told to skip their checks first:
:func:`~npu_inject.step_recovery.pause_watchdogs`): the rank waiting in a collective on the failed one
is freed ("FORCE STOP") and its queued work dropped, as the failed rank's is. Once every rank's device is stopped
(each says so in the store: a communicator dropped while a peer still runs a collective on it has that peer's
watchdog end its process), each destroys its HCCL communicators and the store keys they were made through
(torch_npu makes new ones at the retry's first collective), restarts its device (``restart_device``, which
repairs the UCE's memory), writes its report and waits for every rank's; when all say they can retry, FSDP (with
the settings the step began with: torchtitan's chunked loss switches lm_head's off for its chunks) and the
pipeline schedule are reset to before the step and every rank trains the step again on the same batches. No
process restarts, no checkpoint is read.

Layouts: the retry is trusted where the CANN emulation showed every later loss equal to the run without the fault
(FSDP or DDP, FSDP x TP and PP, every fault); elsewhere (CP, EP) every rank stops with one line saying so
(:func:`unverified_layout`).

What stops every rank, with the same line naming the rank and the cause (torchrun's restart and the last
checkpoint take over): a fault after the step's optimizer began on any rank (its update may be applied on some
ranks and not others), a UCE in the job's state or outside torch_npu's pool, a second fault in the same step, a
fault met as a step began (the previous step's update was in flight), torch_npu's task queue ended, and a rank
that writes no report within 60 seconds (or ``stuck_after``, if longer: a process gone or stuck on the host).

The cost when nothing fails: two device synchronisations per step, one before the optimizer (a fault in the
step's forward or backward is reported before the update begins, so the step can be retried) and one as the next
step begins (a fault in this step's update is not mistaken for the next step's); no collective, no store round
trip on the training thread (each rank's watcher thread looks at the store every ``poll`` seconds, default 1).

A failed collective is repaired only with ``TORCH_HCCL_ASYNC_ERROR_HANDLING=0``: with torch_npu's default (1) its
watchdog ends the process on a failed communicator first (torchrun's restart then takes over, as without this
patch). The patch does not change it: the watchdog's teardown is the user's to give up; the report says which
applies. With it 0, the flight recorder's dump on a failed work goes too (:func:`keep_dumps_off`)."""

from __future__ import annotations

import gc
import logging
import os
import time

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.repair_channel import RepairChannel, Watcher
from npu_inject.step_recovery import (FORCE_STOP, QUEUE_ENDED, TEMPORARY, UCE_MARK, WHERE, drop_hccl_comms,
                                      fsdp_settings, names_hccl, pause_watchdogs, reset_fsdp, reset_pipeline,
                                      unsynced_gradients)
from npu_inject.training_step import RETRY, Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")
ERROR_HANDLING = "TORCH_HCCL_ASYNC_ERROR_HANDLING"
DUMP_ON_FAILURE = "TORCH_HCCL_DUMP_ON_TIMEOUT"  # torch_npu's name; it covers failed works too


def fault_kind(text: str) -> str | None:
    """What a step's error says happened on the device: "uce", "stopped" (this rank's device was stopped: a peer's
    fault or a stuck step), "collective" (an HCCL call failed), "queue_ended"; None: not a device fault."""
    if UCE_MARK in text:
        return "uce"
    if QUEUE_ENDED in text:
        return "queue_ended"
    if FORCE_STOP in text:
        return "stopped"
    if names_hccl(text):
        return "collective"
    return None


def chain_text(error: BaseException) -> str:
    """An error's text with that of the errors it was raised from (a pipeline stage re-raises a kernel's error
    under its own message)."""
    texts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def unverified_layout(parallel_dims) -> str:
    """Why a retry of this job's layout is not trusted (an empty string: trusted).

    Trusted where the emulation showed every later loss equal to the run without the fault: FSDP and DDP, and FSDP x
    TP, for each kind (a UCE under FSDP x TP once the FSDP settings torchtitan's chunked loss switches are restored:
    reset_fsdp); PP, every fault (once reset_fsdp drops the gradients the cut step's earlier microbatches left
    unreduced: a first-stage UCE's retry had counted the last stage's first microbatch twice). Not context or
    expert parallelism (not tried). A retry that may train wrong is worse than a stop."""
    if parallel_dims is None:
        return ""
    for name in ("cp", "ep"):
        if getattr(parallel_dims, f"{name}_enabled", False):
            return f"a retry under {name.upper()} is not verified to train as the job would have (stops instead)"
    return ""


def verdict(reports: dict[int, dict], missing: list[int], fault: dict, timeout_s: float) -> str | None:
    """The line every rank stops with, or None when every rank can retry the step; the same on every rank (it
    reads only what every rank reads)."""
    cause = f"rank {fault['rank']}'s {fault['kind']} in step {fault['step']} ({fault['why']})"
    head = f"npu_inject step_repair: step {fault['step']}:"
    if missing:
        return (f"{head} rank(s) {', '.join(map(str, missing))} wrote no report within {timeout_s:g} s after "
                f"{cause}: a process is gone or stuck on the host; every rank stops: torchrun's restart and the last "
                "checkpoint take over")
    for rank in sorted(reports, key=lambda rank: rank != fault["rank"]):  # the faulted rank's first
        if reports[rank]["problem"]:
            return (f"{head} not repairable in the job: rank {rank}: {reports[rank]['problem']}; every rank stops: "
                    f"resume from the last checkpoint (after {cause})")
    steps = sorted({report["step"] for report in reports.values()})
    if len(steps) > 1:
        return (f"{head} ranks stopped in different steps ({', '.join(map(str, steps))}); every rank stops: resume "
                f"from the last checkpoint (after {cause})")
    return None


def keep_dumps_off(ctx: PatchContext) -> None:
    """With torch_npu's teardown off, its dump on a failed collective off too (read when a process group is made;
    torchtitan's process groups are made after this patch applies, on the trainer's import).

    torch_npu 2.14's watchdog, meeting a failed or timed-out work with ``TORCH_HCCL_DUMP_ON_TIMEOUT`` on (what the
    collectives patch sets for torchtitan's default ``--comm.trace_buf_size``), sleeps
    ``TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC`` (600 s) holding its work list, to leave the dump time before it tears the
    process down. With teardown off nothing follows that sleep but a stalled rank: ``restart_device`` clears that
    list and waited for it (PP 2, a failed send: 2 runs of 4 stopped every rank, the failed rank never reporting),
    as would the retry's first collective (the emulation's dumps there also read events of works already gone)."""
    chosen = os.environ.get(DUMP_ON_FAILURE)
    if chosen is None:
        os.environ[DUMP_ON_FAILURE] = "0"
        ctx.add_cleanup(lambda: os.environ.pop(DUMP_ON_FAILURE, None))
        ctx.fallback(f"{ERROR_HANDLING}=0: {DUMP_ON_FAILURE}=0 (torch_npu's flight recorder still records; no "
                     "automatic dump on a failed or timed-out collective, whose watchdog would otherwise stall the "
                     "rank for TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC and stop the repair)")
    elif chosen not in ("0", "false", "False"):
        ctx.fallback(f"{ERROR_HANDLING}=0 with {DUMP_ON_FAILURE}={chosen}: a failed collective that torch_npu's "
                     "watchdog meets first stalls that rank for TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC (600 s) holding its "
                     "work list: every rank then stops, not repaired (unset it to have it repaired)")


def apply(ctx: PatchContext) -> None:
    import threading

    import torch
    import torch_npu

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        ctx.note("one rank: a device memory error is uce_repair's to repair; nothing else to agree on")
    chosen = os.environ.get(ERROR_HANDLING, os.environ.get("HCCL_ASYNC_ERROR_HANDLING"))
    watchdog_off = chosen == "0"
    if chosen != "0" and world_size > 1:  # unset: collectives sets torch_npu's default, 1 (tear down)
        ctx.note(f"{ERROR_HANDLING} is {chosen or 'unset (1, tear down)'}: torch_npu's watchdog ends the process on a "
                 "failed collective before it can be repaired (torchrun's restart takes over); UCEs and stuck "
                 f"collectives are repaired. {ERROR_HANDLING}=0 has failed collectives repaired too, and leaves hangs "
                 "to stuck_after (the watchdog's own timeout then ends nothing)")
    if watchdog_off and world_size > 1:
        keep_dumps_off(ctx)
    poll_s = float(ctx.options.get("poll", 1.0))
    lock = threading.Lock()
    state = {"channel": None, "watcher": None, "stopped": -1, "started": None, "steps": 0, "deadline": None}
    said: set[str] = set()  # notes said once

    def active(trainer) -> bool:  # a torchft job's failures are torchft_recover's
        return world_size > 1 and not getattr(getattr(trainer, "ft_manager", None), "enabled", False)

    def stop_device_once(generation: int, channel: RepairChannel) -> None:
        """Stop this rank's device for ``generation``'s fault and say so through ``channel`` (the calling thread's)."""
        with lock:  # the watcher and the training thread may both come; a repair done is not stopped again
            if state["stopped"] == generation or generation != state["channel"].generation:
                return
            state["stopped"] = generation
        pause_watchdogs()
        torch_npu.npu.stop_device(state["device"])
        channel.stopped()

    def overdue() -> dict | None:
        started, deadline = state["started"], state["deadline"]
        if started is None or deadline is None or time.monotonic() - started < deadline:
            return None
        return {"rank": rank, "step": state["step"], "attempt": state["attempt"], "kind": "stuck",
                "why": f"the step ran over {deadline:g} s (stuck_after): a collective that never completes"}

    def start(trainer) -> None:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        state["device"] = trainer.device.index or 0
        # A hang is the watchdog's while it tears down (its timeout dumps the flight recorder); with it off, or with
        # stuck_after set, a step past the deadline is called stuck here.
        stuck_after = float(ctx.options.get("stuck_after", 0)) or (
            float(trainer.config.comm.train_timeout_seconds) if watchdog_off else 0.0)
        state["stuck_after"] = stuck_after
        state["report_within"] = max(60.0, stuck_after)  # every rank's stop, restart and communicators dropped
        state["channel"] = RepairChannel(store, rank, world_size)
        watching = RepairChannel(store.clone(), rank, world_size)
        watcher = Watcher(watching, generation=lambda: state["channel"].generation,
                          on_fault=lambda generation, fault: stop_device_once(generation, watching),
                          overdue=overdue, poll_s=poll_s)
        watcher.start()
        ctx.add_cleanup(watcher.close)
        state["watcher"] = watcher
        stuck = (f"a step past {stuck_after:g} s is stuck" if stuck_after else
                 "a hang is torch_npu's watchdog's (stuck_after unset and the watchdog tearing down)")
        ctx.note(f"{world_size} ranks: a repairable device fault on any rank stops every rank's device and retries "
                 f"the step; {stuck}")

    def stop_everywhere(step: Step, kind: str, why: str, problem: str):
        """Publish a fault that cannot be repaired; the repair stops every rank with the same line."""
        fault = state["channel"].publish({"rank": rank, "step": step.number, "attempt": step.attempt, "kind": kind,
                                          "why": why})
        repair(step, kind, fault, problem)

    def before_step(step: Step) -> None:
        if not active(step.trainer):
            if world_size > 1 and "torchft" not in said:
                said.add("torchft")
                ctx.note("a torchft job: a failed or stopped collective is torchft_recover's (the replica group "
                         "discards the step), a UCE stops the rank (torchft heals it)")
            return
        if state["channel"] is None:
            if not torch.distributed.is_initialized():  # torchtitan's fake comm modes: nothing to agree through
                if "no process group" not in said:
                    said.add("no process group")
                    ctx.fallback(f"WORLD_SIZE {world_size} without a default process group: no store to agree "
                                 "through; device faults are not repaired")
                return
            start(step.trainer)
        try:
            torch.accelerator.synchronize()  # the previous step's update has run: a fault from here on is this step's
        except RuntimeError as exc:
            kind = fault_kind(chain_text(exc)) or "error"
            stop_everywhere(step, kind, " ".join(str(exc).split())[:200],
                            f"a device fault met as step {step.number} began ({kind}): the previous step's optimizer "
                            "update was in flight and may be cut")
        state["fsdp"] = fsdp_settings(step.trainer.model_parts)  # what a step cut midway leaves switched, restored
        state["unsynced"] = unsynced_gradients(step.trainer.model_parts)  # none under torchtitan: reset_fsdp drops all
        state["steps"] += 1
        state["step"], state["attempt"] = step.number, step.attempt
        state["deadline"] = (state["stuck_after"] or None) if state["steps"] > 1 else None  # the first step compiles
        state["started"] = time.monotonic()

    def before_optimizer(step: Step) -> None:
        if state["channel"] is not None and active(step.trainer):
            torch.accelerator.synchronize()  # a fault in the forward or backward is reported before the update

    def after_step(step: Step) -> None:
        state["started"] = None

    def on_failure(step: Step, error: Exception):
        if state["channel"] is None or not isinstance(error, RuntimeError) or not active(step.trainer):
            return None
        text = chain_text(error)
        kind = fault_kind(text)
        if kind is None:
            return None
        state["started"] = None
        innermost = text.split("\n")[-1] if kind != "stopped" else text  # the kernel's or HCCL's own words
        why = " ".join(innermost.split())[:200]
        mine = {"rank": rank, "step": step.number, "attempt": step.attempt, "kind": kind, "why": why}
        fault = state["channel"].publish(mine)  # the peers' watchers stop their devices now
        return lambda: repair(step, kind, fault)

    def unrepairable(step: Step, kind: str) -> str:
        """Why this rank's fault cannot be repaired in the job ('' when it can); the device is stopped."""
        if kind == "queue_ended":
            return "torch_npu's task queue ended"
        if step.update_began:
            return (f"the fault ({kind}) came after the step's optimizer update began: the weights or optimizer "
                    "states may hold part of it")
        if step.attempt > 0:
            return f"a second device fault ({kind}) in the same step after a repair: the device or link is failing"
        if state.get("unsynced"):
            return (f"{state['unsynced']} FSDP parameters held gradients not yet reduced as the step began (gradient "
                    "sync off across steps): the failed attempt's part of them cannot be taken out")
        if kind == "uce":
            where = torch_npu.npu.check_uce_in_memory(state["device"])
            if where != TEMPORARY:
                return f"a device memory error (UCE) in {WHERE.get(where, f'memory of kind {where}')}"
        return ""

    def repair(step: Step, kind: str, fault: dict, problem: str = ""):
        """Stop, drop the communicators, restart the device unless ``problem`` (or one found here) says it cannot be
        repaired, report and settle: stop every rank with the verdict's line, or reset and retry the step."""
        channel = state["channel"]
        stop_device_once(channel.generation, channel)
        gc.collect()  # the failed attempt's tensors go back to the allocator
        problem = (problem or unrepairable(step, kind)
                   or unverified_layout(getattr(step.trainer, "parallel_dims", None)))
        began = time.monotonic()
        # Dropped once every rank's device is stopped (their watchdogs skip their checks then; a peer still running a
        # collective on a dropped communicator would have its watchdog end its process) and while this one is: a
        # failed communicator left for restart_device to find would have the watchdog tear this process down. A rank
        # not stopped in time is named by the reports below.
        channel.wait_stopped(state["report_within"])
        drop_hccl_comms("npu_inject step_repair")
        if not problem:
            torch_npu.npu.restart_device(state["device"])
        reports, missing = channel.reports({"step": step.number, "problem": problem}, state["report_within"])
        line = channel.settle(verdict(reports, missing, fault, state["report_within"]))
        if line is not None or problem:
            stop_run(line or f"npu_inject step_repair: {problem}")
        reset_fsdp(step.trainer.model_parts, state["fsdp"])
        reset_pipeline(step.trainer)
        channel.generation += 1  # the watcher looks at the next generation's keys from now on
        waited = time.monotonic() - began
        state["attempt"], state["started"] = step.attempt + 1, time.monotonic()  # the retry's own clock
        note = (f"step {step.number}: rank {fault['rank']}'s {fault['kind']} repaired on every rank (devices stopped "
                f"and restarted, HCCL communicators made anew, {waited:.1f} s), step trained again on the same batches")
        ctx.note(note)
        logger.warning("npu_inject step_repair: %s (%s)", note, fault["why"])
        return RETRY

    take_part(ctx, before_step=before_step, before_optimizer=before_optimizer, after_step=after_step,
              on_failure=on_failure)
