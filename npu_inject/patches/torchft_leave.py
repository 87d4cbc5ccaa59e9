"""A replica group that fails or hangs leaves torchft's quorum within the configured timeouts, not holding the others'.

Module ``torchtitan.experiments.torchft.trainer`` (``--module torchft.*`` with ``--fault_tolerance.enable``).

torchft's lighthouse forms no quorum while a replica group heartbeats without joining it (its rule against a
split brain: the joining groups must be more than half of those heartbeating). A group's heartbeats come from
its manager, in group rank 0's process, and go on until that process ends. A rank 0 that fails mid-step (here:
its peer hung, and its own collective timed out after ``--comm.train_timeout_seconds``) does not end: before the
interpreter exits it joins torchft's quorum thread, which waits for the hung peer until torchft's quorum timeout
(60 s). Measured on the rehearsal (``hang@4:rank=1`` in group 1): group 1's rank 0 failed after 15 s and
heartbeated 60 s more; group 0's own quorum timed out at the same 60 s and both groups went down.

Here an exception leaving ``FaultTolerantTrainer.train`` first shuts torchft's manager down without waiting (its
server, so the heartbeats, its checkpoint transport, its thread pool), then goes on as upstream does. The
lighthouse drops the group after its heartbeat timeout and the other groups go on. Noted in the report.

How soon a group with a hung rank fails is its other ranks' collective timeout. torchft's trainer lowers it to
``--comm.train_timeout_seconds`` after the step numbered 1 only (``self.step == 1``), so a group that healed
from a peer to a later step, or resumed from a checkpoint, keeps ``--comm.init_timeout_seconds`` (300 s) for
its whole run: measured, a restarted group 1 healed to step 4, its rank 1 hung at step 5, and rank 0 waited
300 s. (torchtitan's own trainer counts from the step it loaded; its torchft trainer does not.)
Here, when a process's first step ends on a step other than 1, the timeout is lowered there, as upstream does
after step 1 (the same call: a barrier of the group, then every group of the mesh and the default group).
"""

from __future__ import annotations

import logging

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.experiments.torchft.trainer:FaultTolerantTrainer.train",
    "torchtitan.experiments.torchft.trainer:FaultTolerantTrainer.train_step",
)

logger = logging.getLogger("npu_inject")


def apply(ctx: PatchContext) -> None:
    from datetime import timedelta

    from torchtitan.distributed import utils as dist_utils

    stepped: set[int] = set()  # trainers (by id) whose first step in this process has ended

    def train(original, trainer, *args, **kwargs):
        try:
            return original(trainer, *args, **kwargs)
        except BaseException as error:
            ft_manager = getattr(trainer, "ft_manager", None)
            if ft_manager is not None and ft_manager.enabled:
                why = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
                logger.warning("npu_inject torchft_leave: training failed (%s); this rank's torchft manager is "
                               "shut down now, so its replica group leaves the quorum", why)
                ctx.note(f"left torchft's quorum as training failed ({why})")
                ft_manager.manager.shutdown(wait=False)
            raise

    def train_step(original, trainer, *args, **kwargs):
        result = original(trainer, *args, **kwargs)
        if id(trainer) not in stepped:
            stepped.add(id(trainer))
            if trainer.step != 1:  # upstream lowers it after step 1 only
                seconds = trainer.config.comm.train_timeout_seconds
                dist_utils.set_pg_timeouts(timeout=timedelta(seconds=seconds), parallel_dims=trainer.parallel_dims)
                ctx.note(f"collective timeout lowered to --comm.train_timeout_seconds ({seconds} s) after this "
                         f"process's first step, step {trainer.step} (upstream: after step 1 only)")
        return result

    ctx.wrap("FaultTolerantTrainer.train", train)
    ctx.wrap("FaultTolerantTrainer.train_step", train_step)
