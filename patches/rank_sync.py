"""rank_sync: every rank must run the same patches; say which, once.

Right after torchtitan creates the process group (``Trainer.init_distributed``),
the ranks exchange their sets of applied patches. Different sets would make
collectives hang or diverge silently, so a mismatch fails the run at once with
the ranks and patches named. Then each rank writes its report as JSON into
``<dump_folder>/npu_inject/report_rank<N>.json`` and rank 0 logs one summary line.
"""

from __future__ import annotations

from npu_inject import runtime as runtime_mod
from npu_inject.patching import PatchContext

TRIGGERS = ("torchtitan.trainer",)
TARGETS = ("torchtitan.trainer:Trainer.init_distributed",)
SUPPORTS = {"torchtitan": ">=0.3.0,<0.4"}
REQUIRES = ()


def mismatch_message(applied_by_rank: list[list[str]]) -> str | None:
    """None when all ranks agree, else which ranks differ in which patches."""
    reference = set(applied_by_rank[0])
    lines = []
    for rank, applied in enumerate(applied_by_rank[1:], start=1):
        extra, missing = set(applied) - reference, reference - set(applied)
        if extra or missing:
            lines.append(
                f"rank {rank} vs rank 0: only on rank {rank}: {sorted(extra) or '-'}; "
                f"only on rank 0: {sorted(missing) or '-'}"
            )
    if not lines:
        return None
    return (
        "npu_inject: ranks applied different patches, which would hang or corrupt collectives: "
        + "; ".join(lines)
        + ". Give every rank the same TORCHTITAN_NPU* environment and the same installed versions."
    )


def check_ranks_and_report(trainer) -> None:
    import torch.distributed as dist

    runtime = runtime_mod.current()
    if runtime is None:
        return
    runtime.set_dump_folder(trainer.config.dump_folder)
    applied = sorted(runtime.report.ids("applied"))
    if dist.is_initialized() and dist.get_world_size() > 1:
        applied_by_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(applied_by_rank, applied)
        message = mismatch_message(applied_by_rank)
        if message:
            runtime.write_report()
            raise RuntimeError(message)
    runtime.write_report()
    if runtime.report.rank == 0:
        runtime_mod.log_summary(runtime)


def _after_init_distributed(wrapped, instance, args, kwargs):
    parallel_dims = wrapped(*args, **kwargs)
    check_ranks_and_report(instance)
    return parallel_dims


def apply(ctx: PatchContext) -> None:
    ctx.wrap("torchtitan.trainer:Trainer.init_distributed", _after_init_distributed)


def revert(ctx: PatchContext) -> None:
    """The recorded wrapper is all there is to undo."""
