"""A worker group that torchrun restarts does not silently train again from the initial weights.

Module ``torchtitan.trainer``: ``Trainer.train_step`` (and the overrides of torchft's, flux's and the graph
trainer's), under torchrun (``TORCHELASTIC_RESTART_COUNT`` set); outside torchrun it changes nothing.

torchrun's ``--max-restarts`` brings a failed worker group back, and what the new attempt starts from is the
trainer's business: the newest checkpoint, or with torchft the live state of a healthy replica group. With
neither (checkpoints off or none written yet, every replica group restarted at once: on NPUs a failure inside
the cross-group all-reduce takes the surviving group down too), the attempt begins again at step 1 from the
initial weights, and the log looks like training: every step the dead attempts made is lost without a word.

Here rank 0 records each finished step in the launcher's store, which outlives the attempts (the key is
outside :mod:`npu_inject.patches.restart_store`'s per-attempt prefix). A restarted attempt that begins at step
1 while an earlier attempt reached step N > 1 is watched: without torchft every rank stops after that step
with one line naming both; a torchft group may train a few steps alone before a quorum with a live peer heals
it (its step jumps inside a step), so it stops only once it has trained to step N again without healing. Each
further attempt torchrun makes stops the same way. ``TORCHTITAN_NPU_PATCHES=-restart_progress`` lets such a
restart train from scratch. Its cost: rank 0 sets one key of the launcher's store per step (one round trip).
"""

from __future__ import annotations

import os

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
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
    state = {"first_step": True, "watching": False, "earlier": 0, "store": None}

    def stop(attempt_began: str, earlier: int) -> None:
        stop_run(f"npu_inject restart_progress: restart attempt {attempt} of this worker group {attempt_began}, from "
                 f"the initial weights, after an earlier attempt reached step {earlier}: no checkpoint was loaded "
                 "and no torchft peer was ahead to heal from, so every step since would be lost without a word. "
                 "Keep checkpoints (--checkpoint.enable --checkpoint.interval N), or allow it with "
                 "TORCHTITAN_NPU_PATCHES=-restart_progress")

    def train_step(original, trainer, *args, **kwargs):
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
        store = state["store"]
        began = trainer.step
        result = original(trainer, *args, **kwargs)
        if state["watching"]:
            earlier = state["earlier"]
            if trainer.step != began:  # a torchft group healed from a peer's live state inside the step
                state["watching"] = False
                ctx.note(f"restart attempt {attempt} healed to step {trainer.step} after training to step {began} "
                         f"from the initial weights (an earlier attempt reached step {earlier})")
            elif not getattr(getattr(trainer, "ft_manager", None), "enabled", False):
                stop("began again at step 1", earlier)
            elif trainer.step >= earlier:
                # torchft: a restarted group may train a few steps alone before a quorum with a live peer heals it
                stop(f"trained from step 1 to step {trainer.step} again without healing from a torchft peer", earlier)
        if rank == 0 and store is not None:
            store.set(STEP_KEY, str(trainer.step))
        return result

    ctx.wrap_overrides("Trainer.train_step", train_step)
