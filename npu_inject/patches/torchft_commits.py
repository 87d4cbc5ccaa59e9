"""torchft in the rehearsal: NCCL and HCCL settings run on gloo, and a run whose steps torchft never commits stops.

Module ``torchtitan.experiments.torchft.manager`` (``--module torchft.llama3 ... --fault_tolerance.enable``),
and torchft's ``Manager.should_commit``:

* ``TorchFTManager.__init__`` builds torchft's process group from ``--fault_tolerance.process_group``;
  upstream's ``llama3_torchft_debugmodel`` names ``nccl``. Off CUDA torchft's NCCL group fails at every
  quorum ("ProcessGroupNCCL is only supported with GPUs"), every step ends ``should_commit=False``, and
  the log still looks like training. In the rehearsal ``nccl`` and ``hccl`` (the runtime's HCCL group,
  :mod:`npu_inject.patches.torchft_npu`, what both run on on NPUs) are run on torchft's gloo group instead
  (noted), as the device patch runs the main process group on gloo.
* ``Manager.should_commit`` is watched: when the first ``stop_after`` (registry option, default 5) commit
  points of a replica group (one per step; one per synchronisation with DiLoCo or LocalSGD) commit
  nothing, every rank stops with one line naming torchft's recorded error, instead of training on with
  nothing applied. Once a step was committed, an
  uncommitted one (a peer group failed, a quorum is being rebuilt) is torchft's recovery at work: it is
  noted in the report, never stopped on.

Bad input stops at start-up in model_guard, one line each: torchft not installed, a process group name
TorchFTManager does not build, TORCHFT_LIGHTHOUSE unset or nobody answering there.
"""

from __future__ import annotations

import dataclasses
import logging

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.experiments.torchft.manager:TorchFTManager.__init__",
    "torchft.manager:Manager.should_commit",
)

logger = logging.getLogger("npu_inject")


def apply(ctx: PatchContext) -> None:
    stop_after = ctx.options["stop_after"]  # registry.json's option_rules keep it >= 1
    counts = {"calls": 0, "committed": 0, "uncommitted": 0}

    def init(original, manager, config, *args, **kwargs):
        if ctx.rehearsal and config.enable and config.process_group in ("nccl", "hccl"):
            ctx.note(f"--fault_tolerance.process_group {config.process_group} runs on torchft's gloo group in the "
                     "rehearsal (torchft's NCCL group needs CUDA GPUs: every quorum would fail and no step would "
                     "commit; its HCCL group, NPUs)")
            config = dataclasses.replace(config, process_group="gloo")
        return original(manager, config, *args, **kwargs)

    def should_commit(original, manager, *args, **kwargs):
        committed = original(manager, *args, **kwargs)
        counts["calls"] += 1
        if committed:
            counts["committed"] += 1
            return committed
        counts["uncommitted"] += 1
        error = manager.errored()
        why = " ".join(str(getattr(error, "original_exception", error)).split())[:300] if error else "none recorded"
        if counts["committed"]:
            ctx.note(f"step {manager.current_step()}: torchft did not commit it ({why}); "
                     f"{counts['uncommitted']} of {counts['calls']} uncommitted so far")
        elif counts["calls"] >= stop_after:
            stop_run(f"npu_inject torchft_commits: torchft committed none of its first {counts['calls']} commit "
                     f"points (one per step; one per synchronisation with DiLoCo or LocalSGD) on replica "
                     f"{getattr(manager, '_replica_id', '?')}: the run would train on without any of them applied. "
                     f"torchft's error: {why}; check --fault_tolerance.process_group, "
                     "--fault_tolerance.min_replica_size and the lighthouse")
        return committed

    ctx.wrap("TorchFTManager.__init__", init)
    ctx.wrap("Manager.should_commit", should_commit)
