"""Faults on purpose, to rehearse what a long job meets: TORCHTITAN_NPU_FAULTS names them.

Off by default; ``TORCHTITAN_NPU_PATCHES=+inject_faults`` with ``TORCHTITAN_NPU_FAULTS`` set causes
them (the variable set without the patch stops at start-up: faults asked for and silently not caused
would let a recovery check pass for nothing). Its form is ``KIND@STEP`` or ``KIND@STEP:rank=R``,
comma-separated; a bad item stops at start-up naming it.

* ``nan_loss@K``: during training step K, the output of the rank's first model part is multiplied by
  NaN, so that rank's loss and, through the gradient reduction, every rank's gradients are NaN (what a
  bad batch or an overflow does). With :mod:`npu_inject.patches.finite_steps` the step is then not
  applied; without it, torchtitan writes NaN into the weights.
* ``kill@K``: as step K starts, the rank's process sends itself SIGKILL: no exception, no cleanup, what
  a lost node or the OOM killer leaves. Its peers' next collective fails or times out.
* ``hang@K``: as step K starts, the rank sleeps and never returns, as a hung device or a collective
  whose peer is gone would: its peers' next collective times out (``--comm.train_timeout_seconds``,
  torchft's ``--fault_tolerance.process_group_timeout_ms``).

* ``kill_in_forward@K``, ``hang_in_forward@K``: the same, in the rank's forward of step K (a forward pre-hook
  of its first model part), after the step began: with torchft the rank's group has joined the step's
  quorum, so its peers meet the failure inside a collective (their group's, or torchft's cross-group
  all-reduce) instead of before it.

``kill`` and ``hang`` (and their ``_in_forward`` forms) fire as the first step at or after K starts (a rank healed from a torchft peer
jumps to the peer's step), in the launcher's first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT
unset or 0): the ranks ``--max-restarts`` brings back train on, which is what a recovery check needs.

Module ``torchtitan.trainer``: ``Trainer.train_step`` is wrapped; a forward hook lives for the chosen
step only. Each fault caused is noted in the report.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)


def _times_nan(module, args, output):
    if isinstance(output, tuple):
        return (output[0] * float("nan"), *output[1:])
    return output * float("nan")


def stop(kind: str, step: int) -> None:
    """Kill or hang this rank now. Said on stderr, not in the report: a killed or hung rank writes no report."""
    print(f"npu_inject inject_faults: step {step}: {kind} on rank {os.environ.get('RANK', '0')}",
          file=sys.stderr, flush=True)
    if kind.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()


def apply(ctx: PatchContext) -> None:
    from npu_inject import selection

    faults = selection.current().settings.faults
    rank = int(os.environ.get("RANK", "0"))
    mine = [fault for fault in faults if fault.rank in (None, rank)]
    nan_steps = {fault.step for fault in mine if fault.kind == "nan_loss"}
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    stops = {fault.step: fault.kind for fault in mine
             if fault.kind in ("kill", "hang", "kill_in_forward", "hang_in_forward") and first_attempt}

    active: list = []  # the hook of the step in progress (an override calling super() nests)

    def train_step(original, trainer, *args, **kwargs):
        # the first step at or after K: a rank that healed from a torchft peer may jump past K
        due = [step for step in stops if step <= trainer.step]
        kind = stops[min(due)] if due else None
        if kind and not active:
            if kind in ("kill", "hang"):
                stop(kind, trainer.step)
            # the model's forward: the step's quorum and its first collectives have begun
            step = trainer.step
            trainer.model_parts[0].register_forward_pre_hook(lambda module, args: stop(kind, step))
            del stops[min(due)]
        if trainer.step not in nan_steps or active:
            return original(trainer, *args, **kwargs)
        active.append(trainer.model_parts[0].register_forward_hook(_times_nan))
        ctx.note(f"step {trainer.step}: nan_loss injected on rank {rank}")
        try:
            return original(trainer, *args, **kwargs)
        finally:
            active.pop().remove()

    # torchft's, flux's and the graph trainer's train_step override the base one
    ctx.wrap_overrides("Trainer.train_step", train_step)
