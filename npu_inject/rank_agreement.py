"""Runtime service: every rank runs the same patches, and each rank's report is written.

Not a patch (no id, nothing to switch off): a job whose ranks applied different
patches would hang in a collective or diverge silently, so this check is part of the
runtime. Right after torchtitan creates the process group (``Trainer.init_distributed``)
the ranks exchange their sets of applied patches; a mismatch fails the run at once
with the ranks and patches named. The same exchange carries the values patches need the
whole job to share (``PatchContext.agree_with_rank0``): rank 0's proposal is handed to
every rank, and so does each rank's host and device, which :func:`who` names (the patches that say
which rank to drain need no collective of their own for it). Then each rank writes its report as JSON into
``<dump_folder>/npu_inject/report_rank<N>.json`` and rank 0 logs one summary line.

The runtime installs this service and hands itself in (:func:`install`); nothing here imports
:mod:`npu_inject.runtime`.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

TARGET = "torchtitan.trainer:Trainer.init_distributed"

# (host, device) of each rank of the default process group, learned at start-up; [] before.
PLACES: list[tuple[str, str]] = []


def who(rank: int) -> str:
    """``rank R (host, device)`` of a rank of the default process group (``rank R`` alone before start-up)."""
    if 0 <= rank < len(PLACES):
        host, device = PLACES[rank]
        return f"rank {rank} ({host}, {device})"
    return f"rank {rank}"


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


def rank0_values(proposals_by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's proposals, once every rank proposed values for the same names."""
    reference = proposals_by_rank[0]
    for rank, proposals in enumerate(proposals_by_rank[1:], start=1):
        if set(proposals) != set(reference):
            raise RuntimeError(
                f"npu_inject: ranks proposed different values to agree on (PatchContext.agree_with_rank0): "
                f"rank {rank} proposed {sorted(proposals)}, rank 0 {sorted(reference)}; a patch must "
                "register the same names on every rank"
            )
    return dict(reference)


def pending_agreements(runtime: Any) -> list[tuple[str, Any, Any]]:
    """(patch_id.name, proposal, use) of the applied patches, taken: each is used once."""
    pending = []
    for patch_id in sorted(runtime.ids("applied")):
        context = runtime.states[patch_id].context
        pending.extend((f"{patch_id}.{name}", proposal, use) for name, proposal, use in context.agreements)
        context.agreements.clear()
    return pending


def check_ranks_and_report(runtime: Any, dump_folder: str, device: Any = None) -> None:
    import torch.distributed as dist

    runtime.set_dump_folder(dump_folder)
    place = (socket.gethostname(), str(device))
    PLACES[:] = [place]
    applied = sorted(runtime.ids("applied"))
    pending = pending_agreements(runtime)
    agreed = {key: proposal for key, proposal, _ in pending}
    # A fake process group (torchtitan's dry runs, npu-inject plan) is one process standing for
    # every rank: there is no other process to agree with, and it exchanges no data.
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        exchanged: list = [None] * dist.get_world_size()
        dist.all_gather_object(exchanged, (applied, agreed, place))
        message = mismatch_message([rank_applied for rank_applied, _, _ in exchanged])
        if message:
            runtime.write_report()
            raise RuntimeError(message)
        agreed = rank0_values([proposals for _, proposals, _ in exchanged])
        PLACES[:] = [rank_place for _, _, rank_place in exchanged]
    for key, _, use in pending:
        use(agreed[key])
    runtime.write_report()
    if runtime.rank == 0:
        logging.getLogger("npu_inject").info(runtime.report.summary_line())


def install(runtime: Any):
    """Hook ``Trainer.init_distributed``; returns the PatchContext that undoes it."""
    from npu_inject.patching import PatchContext

    context = PatchContext(patch_id="runtime", device_kind=runtime.settings.target, options={},
                           declared_targets=(TARGET,))

    depth = [0]  # an override calling super().init_distributed() reaches this twice: check once

    def init_distributed(original, trainer, *args, **kwargs):
        depth[0] += 1
        try:
            parallel_dims = original(trainer, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            check_ranks_and_report(runtime, trainer.config.dump_folder, getattr(trainer, "device", None))
        return parallel_dims

    # torchft's FaultTolerantTrainer overrides init_distributed without calling the base method.
    context.wrap_overrides(TARGET, init_distributed)
    return context
