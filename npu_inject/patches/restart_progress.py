"""A worker group that torchrun restarts does not silently train again from the initial weights.

Module ``torchtitan.trainer``: the patch takes part in ``Trainer.train_step`` (:mod:`npu_inject.training_step`,
before and after each step), under torchrun (``TORCHELASTIC_RESTART_COUNT`` set); outside torchrun it changes nothing.

torchrun's ``--max-restarts`` brings a failed worker group back, and what the new attempt starts from is the
trainer's business: the newest checkpoint, or with torchft the live state of a healthy replica group. With
neither (checkpoints off or none written yet, every replica group restarted at once: on NPUs a failure inside
the cross-group all-reduce takes the surviving group down too), the attempt begins again at step 1 from the
initial weights, and the log looks like training: every step the dead attempts made is lost without a word.

Here rank 0 records each finished step in the launcher's store, which outlives the attempts (the key is
outside :mod:`npu_inject.patches.restart_store`'s per-attempt prefix). A restarted attempt that begins at step
1 while an earlier attempt reached step N > 1 is watched: without torchft every rank stops after that step
with one line naming both; a torchft group may train a few steps alone before a quorum with a live peer heals
it, and heals only at a quorum, so it stops at the first commit point (torchft's ``Manager.should_commit``,
after the quorum and its heal) at or after step N that did not heal it: every step in a synchronous job, a
synchronisation under DiLoCo or LocalSGD (a group killed at step 8 that synchronises every 10 steps first meets
its peers at step 10), or ``--fault_tolerance.sync_steps`` past step N without one. Each further attempt
torchrun makes stops the same way. ``TORCHTITAN_NPU_PATCHES=-restart_progress`` lets such a restart train from scratch. Its
cost: rank 0 sets one key of the launcher's store per step (one round trip).

A heal is recognised by torchft's own signal: its manager loads a peer's torchft state
(``Manager.load_state_dict``, which torchft calls only when it heals, on its quorum thread). torchtitan's step
counter is no such signal: under DiLoCo and LocalSGD a heal restores the model and torchft's step at a
synchronisation, and whether torchtitan's step moves with it depends on the train state served; a group that
healed at its first synchronisation was stopped at step 8 as if it had trained from scratch (upstream's
``llama3_torchft_debugmodel``, group 1 killed at step 8). A semi-synchronous group meets its peers only at its
synchronisations, so the lighthouse must wait for them (``--join_timeout_ms``, torchft's default 60 s, longer
than the time between two synchronisations): with a shorter one, the restarted group formed its quorums alone
and never healed, and its stop line says so.
"""

from __future__ import annotations

import os

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.training_step import Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
    ("torchft.manager:Manager.load_state_dict", "in a torchft job restarted by torchrun"),
    ("torchft.manager:Manager.should_commit", "in a torchft job restarted by torchrun"),
)

STEP_KEY = "npu_inject/restart_progress/step"  # in the launcher's store, under no attempt's prefix


def launcher_store():
    """The launcher's own store behind the default process group's prefixes, or None without one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def apply(ctx: PatchContext) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        ctx.note("not under torchrun: no restart to watch")
    rank = int(os.environ.get("RANK", "0"))
    state = {"first_step": True, "watching": False, "earlier": 0, "store": None, "healed": False,
             "commit_points": 0, "commit_points_before": 0}

    def stop(attempt_began: str, earlier: int, hint: str = "") -> None:
        stop_run(f"npu_inject restart_progress: restart attempt {attempt} of this worker group {attempt_began}, from "
                 f"the initial weights, after an earlier attempt reached step {earlier}: no checkpoint was loaded "
                 f"and no torchft peer was ahead to heal from{hint}, so every step since would be lost without a "
                 "word. Keep checkpoints (--checkpoint.enable --checkpoint.interval N), or allow it with "
                 "TORCHTITAN_NPU_PATCHES=-restart_progress")

    def load_state_dict(original, manager, *args, **kwargs):
        state["healed"] = True  # torchft heals: it loads the peer's torchft state (its quorum thread)
        return original(manager, *args, **kwargs)

    def should_commit(original, manager, *args, **kwargs):
        try:
            return original(manager, *args, **kwargs)
        finally:
            state["commit_points"] += 1  # a quorum, and its heal if any, came before it

    def before_step(step: Step) -> None:
        trainer = step.trainer
        if state["first_step"]:
            state["first_step"] = False
            # the default process group's store stays the same for the run: unwrapped once
            state["store"] = store = launcher_store() if attempt is not None else None
            if attempt not in (None, "0") and store is not None and store.check([STEP_KEY]):
                state["earlier"] = int(store.get(STEP_KEY))
                # a restart that resumed from a checkpoint begins past step 1
                state["watching"] = trainer.step == 1 and state["earlier"] > 1
                if not state["watching"]:
                    ctx.note(f"restart attempt {attempt} began at step {trainer.step} "
                             f"(an earlier attempt reached step {state['earlier']})")
                elif torchft_job(trainer):
                    ctx.wrap("torchft.manager:Manager.load_state_dict", load_state_dict)
                    ctx.wrap("torchft.manager:Manager.should_commit", should_commit)
        state["commit_points_before"] = state["commit_points"]

    def after_step(step: Step) -> None:
        trainer, store = step.trainer, state["store"]
        if state["watching"]:
            earlier = state["earlier"]
            if state["healed"]:  # torchft loaded a peer's state inside the step
                state["watching"] = False
                ctx.note(f"restart attempt {attempt} healed from a torchft peer in its step {step.number} (torchtitan's "
                         f"step now {trainer.step}) after training from the initial weights (an earlier attempt "
                         f"reached step {earlier})")
            elif not torchft_job(trainer):
                stop("began again at step 1", earlier)
            elif trainer.step >= earlier and (state["commit_points"] > state["commit_points_before"]
                                              or trainer.step >= earlier + sync_steps(trainer)):
                # torchft: a restarted group heals at a quorum with a live peer, which comes at a commit point
                semi_sync = getattr(getattr(trainer.config, "fault_tolerance", None), "semi_sync_method", None)
                hint = (f" (under {semi_sync} a group meets its peers only at its synchronisations: a lighthouse "
                        "whose --join_timeout_ms is shorter than the time between two of them forms a restarted "
                        "group's quorums without the live groups; torchft's default is 60000)" if semi_sync else "")
                stop(f"trained from step 1 to step {trainer.step} again without healing from a torchft peer", earlier,
                     hint)
        if rank == 0 and store is not None:
            store.set(STEP_KEY, str(trainer.step))

    take_part(ctx, before_step=before_step, after_step=after_step)


def sync_steps(trainer) -> int:
    """The steps between two synchronisations of a LocalSGD or DiLoCo job; 0 when every step commits."""
    fault_tolerance = getattr(trainer.config, "fault_tolerance", None)
    return getattr(fault_tolerance, "sync_steps", 0) if getattr(fault_tolerance, "semi_sync_method", None) else 0


def torchft_job(trainer) -> bool:
    """Whether ``trainer`` trains with torchft (torchtitan's FaultTolerantTrainer with fault tolerance on)."""
    return getattr(getattr(trainer, "ft_manager", None), "enabled", False)
