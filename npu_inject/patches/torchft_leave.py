"""A replica group that fails or hangs leaves torchft's quorum within the configured timeouts, not holding the others'.

Module ``torchtitan.experiments.torchft.trainer`` (``--module torchft.*`` with ``--fault_tolerance.enable``):
``FaultTolerantTrainer.train`` and torchft's waits are wrapped; its steps are watched through the step's owner
(:mod:`npu_inject.training_step`, before and after each step).

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

That timeout does not reach every collective: torch_npu's HCCL backend ignores it ("Backend hccl does not
support setting timeout"), so on NPUs a hung peer holds a group for the process group's 300 s or HCCL's
``HCCL_EXEC_TIMEOUT`` (1836 s), far past torchft's 60 s; and on the CANN emulation the training thread waits
for torch_npu's task queue holding the GIL, so no Python thread runs until the collective ends. So from the
end of a process's first step, each step runs under faulthandler's watchdog (a C thread: it needs no GIL):
a step that lasts longer than ``--comm.train_timeout_seconds``, not counting torchft's own waits for its
quorum and its commit vote (torchft's timeouts bound those, and a survivor waits there while a failed group
leaves), prints every thread's stack after ``Timeout (0:00:15)!`` and ends the process with exit code 1:
its heartbeats stop, its group leaves the quorum, torchrun restarts it.
"""

from __future__ import annotations

import faulthandler
import logging
import sys

from npu_inject.patching import PatchContext
from npu_inject.training_step import Step, take_part

TARGETS = (
    "torchtitan.experiments.torchft.trainer:FaultTolerantTrainer.train",
    "torchtitan.experiments.torchft.trainer:FaultTolerantTrainer.train_step",
    "torchft.manager:Manager.wait_quorum",
    "torchft.manager:Manager.should_commit",
)

logger = logging.getLogger("npu_inject")


def apply(ctx: PatchContext) -> None:
    from datetime import timedelta

    from torchtitan.distributed import utils as dist_utils
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    stepped: set[int] = set()  # trainers (by id) whose first step in this process has ended
    watchdog = {"seconds": 0, "in_step": False}  # seconds: 0 until the first step ended (torchft jobs only)

    def arm():
        if watchdog["seconds"] and watchdog["in_step"]:
            faulthandler.dump_traceback_later(watchdog["seconds"], repeat=False, file=sys.stderr, exit=True)

    def disarm():
        if watchdog["seconds"]:
            faulthandler.cancel_dump_traceback_later()

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

    def before_step(step: Step) -> None:
        if isinstance(step.trainer, FaultTolerantTrainer):
            watchdog["in_step"] = True
            arm()
            step.on_exit(end_of_step)

    def end_of_step() -> None:
        watchdog["in_step"] = False
        disarm()

    def after_step(step: Step) -> None:
        trainer = step.trainer
        if not isinstance(trainer, FaultTolerantTrainer) or id(trainer) in stepped:
            return
        stepped.add(id(trainer))
        seconds = trainer.config.comm.train_timeout_seconds
        if trainer.step != 1:  # upstream lowers it after step 1 only
            dist_utils.set_pg_timeouts(timeout=timedelta(seconds=seconds), parallel_dims=trainer.parallel_dims)
            ctx.note(f"collective timeout lowered to --comm.train_timeout_seconds ({seconds} s) after this "
                     f"process's first step, step {trainer.step} (upstream: after step 1 only)")
        ft_manager = getattr(trainer, "ft_manager", None)
        if ft_manager is not None and ft_manager.enabled and seconds > 0:
            watchdog["seconds"] = seconds
            line = (f"from step {trainer.step + 1} a step lasting over --comm.train_timeout_seconds ({seconds} s) "
                    "outside torchft's quorum and commit waits ends this process with every thread's stack "
                    "(faulthandler's \"Timeout\" dump), so its replica group leaves the quorum")
            logger.info("npu_inject torchft_leave: %s", line)
            ctx.note(line)

    def torchft_wait(original, manager, *args, **kwargs):
        disarm()  # torchft's own timeouts bound its waits
        try:
            return original(manager, *args, **kwargs)
        finally:
            arm()

    ctx.wrap("FaultTolerantTrainer.train", train)
    take_part(ctx, before_step=before_step, after_step=after_step)
    ctx.wrap("Manager.wait_quorum", torchft_wait)
    ctx.wrap("Manager.should_commit", torchft_wait)
