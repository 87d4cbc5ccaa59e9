"""Replicas whose parameters or optimizer states drift apart are caught every N steps, repaired from the majority or stopped.

Off by default: ``TORCHTITAN_NPU_PATCHES=+replica_check``. In a job with a replicate dimension
(``--parallelism.data_parallel_replicate_degree`` > 1: DDP, or HSDP with FSDP inside each replica) every
replica applies the same all-reduced gradients to the same weights, so each rank's parameters and optimizer
states are bitwise equal to those of the ranks that hold the same shard in the other replicas. A flipped bit in
one replica's memory, or a wrong update computed on one device, breaks that and trains on silently: nothing
raises, nothing is NaN, and the replicas' next all-reduce averages the wrong replica into the others' gradients.

The patch takes part in the step (:mod:`npu_inject.training_step`, after the step, on every ``every``-th step,
registry option, default 10): each rank sums the bits of each of its parameters' and optimizer states' local
tensors as integers (``view`` as the integer type of the element's size, ``sum(dtype=int64)``, on the device:
a single flipped bit always changes the sum), gathers the vectors of its replicate group in one ``all_gather``
and reads the table back once. Each verified step leaves a snapshot (option ``rollback``, default on:
:class:`Snapshot`, in host memory) and the owner's batches of every step since. Where they differ:

* with a snapshot, every rank puts its parameters, buffers, optimizer states, learning rates and counters back
  to the last verified step and trains the steps since again on the same batches (the step's owner runs
  torchtitan's ``train_step`` for each, its update kept out again where it was the first time), then checks
  again: the replicas agree and every step since trains as if the fault never happened, the contamination of
  the other replicas through the all-reduced gradients undone too. The rank (the minority where three or more
  replicas make a majority, both sides where none does) is named (host, device) in the log and the report; a
  rank named ``stop_after`` times (registry option, default 3) stops every rank with one line: drain its device.
* without one (the first check, or ``rollback`` off): with a majority, each differing tensor is sent from a rank
  of the majority to the others over the replicate group (``broadcast``: bit for bit), checked again, and the
  job trains on, the minority rank named; this cannot take back what the wrong replica's gradients added to
  every replica's updates since the corruption (at most ``every`` steps), which the line says. Without a
  majority, every rank stops with one line naming the tensor, both ranks, and the last verified step.

Cost per checked step: one read of every parameter and optimizer state on the device (the sums: about the
bytes of the weights and Adam's two moments), one all-gather of one int64 per tensor over the replicate group
(and, where the job has several replicate groups, as HSDP's shards or a pipeline's stages, one all-reduce of one
int64 over the job: whether any group differs, so that every rank rolls back together), one device-to-host
copy of the gathered table; the snapshot: a copy of the rank's local weights, buffers and
optimizer states to host memory (pinned where there is a device; queued on the step's stream, no
synchronisation; the same buffers each time), which it occupies for good (noted once in the report: the bytes
per rank), and the host batches of up to ``every`` steps. A repair adds one broadcast per differing tensor
and one more all-gather; a rollback, the steps since the snapshot trained again. Nothing on other steps.

torchft replica groups (``--fault_tolerance.enable``; the replicas are the groups, outside torchtitan's mesh)
are compared through torchft's own all-reduce (its managed process group: each group writes its row of
fingerprints and its replica id into a table the sum fills), rank by rank with the counterpart ranks of the
other participating groups. A group in the minority stops with one line (its replica group leaves the
quorum and heals from a healthy one when torchrun restarts it); the majority's groups train on, naming it;
without a majority every group stops with one line. No rollback or repair across groups: torchft's healing is
the repair. :func:`group_verdict` decides.
"""

from __future__ import annotations

import logging

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.rank_agreement import who
from npu_inject.training_step import OWNER, Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

logger = logging.getLogger("npu_inject")


def local(tensor):
    """A DTensor's local shard, or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def replicated_state(trainer) -> list[tuple[str, object]]:
    """(name, local tensor) of every parameter of the trainer's model parts and every tensor of their optimizer
    states, in an order the same on every replica."""
    import torch

    named, names_of = [], {}
    for index, part in enumerate(trainer.model_parts):
        for name, parameter in part.named_parameters():
            label = name if len(trainer.model_parts) == 1 else f"part{index}.{name}"
            names_of[id(parameter)] = label
            named.append((label, local(parameter.detach())))
    for optimizer in _optimizers(trainer):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                for key, value in sorted(optimizer.state.get(parameter, {}).items()):
                    if isinstance(value, torch.Tensor):
                        named.append((f"{names_of.get(id(parameter), '?')} (optimizer {key})", local(value)))
    return named


def _optimizers(trainer) -> list:
    """torchtitan's optimizers container's torch optimizers (one per model part)."""
    return list(getattr(trainer.optimizers, "optimizers", [trainer.optimizers]))


class Snapshot:
    """What a rollback needs, as a verified step left it: every parameter's, buffer's and optimizer state's local
    tensor copied to host memory, the learning-rate schedulers' state, torchtitan's step and token counters.
    Lives in host memory: the bytes of the rank's shards of the weights and optimizer states (``nbytes``), the
    same buffers at each verified check (``previous``'s, pinned where there is a device).

    No synchronisation: the copies are queued on the stream that computes the step, so the next update cannot
    overwrite a tensor before its copy has read it, and :meth:`restore`'s copies back are queued behind them;
    the host never reads the copies itself."""

    def __init__(self, trainer, step: int, previous: "Snapshot | None" = None) -> None:
        import copy

        import torch

        self.step, self.ntokens_seen = step, getattr(trainer, "ntokens_seen", None)
        self.tensors = [tensor for _, tensor in replicated_state(trainer)]
        for part in trainer.model_parts:
            self.tensors.extend(local(buffer.detach()) for buffer in part.buffers())
        reusable = previous is not None and len(previous.copies) == len(self.tensors) and all(
            host.shape == tensor.shape and host.dtype == tensor.dtype
            for host, tensor in zip(previous.copies, self.tensors))
        self.copies = previous.copies if reusable else [
            torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.device.type != "cpu")
            for tensor in self.tensors]
        for host, tensor in zip(self.copies, self.tensors):
            host.copy_(tensor, non_blocking=True)
        self.schedulers = copy.deepcopy(trainer.lr_schedulers.state_dict())
        # the schedulers' state_dict holds their counters, not the learning rate they last wrote into the groups
        self.groups = [[copy.deepcopy({key: value for key, value in group.items() if key != "params"})
                        for group in optimizer.param_groups] for optimizer in _optimizers(trainer)]
        self.nbytes = sum(copy.nbytes for copy in self.copies)

    def restore(self, trainer) -> None:
        import copy

        import torch

        with torch.no_grad():
            for tensor, host in zip(self.tensors, self.copies):
                tensor.copy_(host, non_blocking=True)
        trainer.lr_schedulers.load_state_dict(self.schedulers)
        for optimizer, groups in zip(_optimizers(trainer), self.groups):
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(copy.deepcopy(saved))
        if self.ntokens_seen is not None:
            trainer.ntokens_seen = self.ntokens_seen


INTEGER_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def fingerprints(tensors) -> object:
    """One int64 per tensor on the device: the sum of its elements' bits read as integers (wrapping, the same on
    every replica)."""
    import torch

    sums = []
    for tensor in tensors:
        bits = tensor.contiguous().view(getattr(torch, INTEGER_OF_SIZE[tensor.element_size()]))
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def disagreement(table: list[list[int]], members: list[int]) -> tuple[int, list[int], list[int]] | None:
    """The first tensor (column) whose value differs across the replicas (rows, ``members`` their global ranks):
    (column, the ranks that are wrong (the minority; all when none is a majority), the ranks that agree), or
    None when every column agrees."""
    for column in range(len(table[0]) if table else 0):
        if len({row[column] for row in table}) > 1:
            source, wrong = majority(table, column, members)
            return column, wrong, [rank for rank in members if rank not in wrong] if source is not None else []
    return None


def majority(table: list[list[int]], column: int, members: list[int]) -> tuple[int | None, list[int]]:
    """(a rank holding the majority's value of ``column``, the ranks that do not), or (None, all) without one."""
    values = [row[column] for row in table]
    value, most = max(((each, values.count(each)) for each in set(values)), key=lambda item: item[1])
    if most * 2 <= len(values):
        return None, list(members)
    return (members[values.index(value)], [rank for rank, each in zip(members, values) if each != value])


def group_verdict(table: list[list[int]], mine: int, names: list[str], tensors: list[str]) -> tuple[str, str] | None:
    """torchft replica groups' fingerprints (rows; ``mine`` this group's row, ``names`` each row's replica id,
    ``tensors`` the columns' names): None when they agree, else (what this group does: "stop" or "train on", the
    line saying why)."""
    found = disagreement(table, list(range(len(table))))
    if found is None:
        return None
    column, wrong, _ = found
    differing = sum(len({row[index] for row in table}) > 1 for index in range(len(table[0])))
    named = ", ".join(f"replica group {names[row]}" for row in wrong)
    what = f"{tensors[column]} ({differing} of {len(tensors)} tensors differ)"
    if len(wrong) == len(table):
        return "stop", (f"the torchft replica groups' {what} and no majority says which group is wrong ({named}): "
                        "drain one after checking their devices, resume from a checkpoint")
    if mine in wrong:
        return "stop", (f"this replica group ({names[mine]}) disagrees with the majority of the torchft replica groups "
                        f"in {what}: it leaves the quorum and heals from a healthy group when torchrun restarts it")
    return "train on", (f"{named} disagreed with the majority of the torchft replica groups in {what} and leaves the "
                        "quorum; this group agrees with the majority")


def apply(ctx: PatchContext) -> None:
    options = ctx.options  # registry.json's option_rules keep each >= 1
    every = options["every"]
    state = {"verified": None, "said_none": False, "snapshot": None, "said_snapshot": False, "said_groups": False}
    strikes: dict[int, int] = {}  # rank: how often it disagreed with the majority
    unverified: list[tuple[int, list, bool]] = []  # the steps after the snapshot: (number, batches, update kept out)

    def verified(step: Step) -> None:
        state["verified"] = step.number
        unverified.clear()
        if options["rollback"]:
            snapshot = state["snapshot"] = Snapshot(step.trainer, step.number, state["snapshot"])
            if not state["said_snapshot"]:
                state["said_snapshot"] = True
                ctx.note(f"rollback snapshot at each verified step: {len(snapshot.tensors)} tensors, "
                         f"{snapshot.nbytes / 2**30:.2f} GiB of host memory on this rank")

    def after_step(step: Step) -> None:
        if not step.discarded:
            unverified.append((step.number, list(step.batches.taken), bool(step.skipped)))
        if step.number % every:
            return
        import torch
        import torch.distributed as dist

        trainer = step.trainer
        ft = getattr(trainer, "ft_manager", None)
        if getattr(ft, "enabled", False):
            compare_groups(step, ft.manager)
            return
        mesh = trainer.parallel_dims.get_optional_mesh("dp_replicate")
        if mesh is None:
            if not state["said_none"]:
                state["said_none"] = True
                ctx.note("no replicate dimension (--parallelism.data_parallel_replicate_degree 1): nothing to compare")
            return
        group = mesh.get_group()
        members = dist.get_process_group_ranks(group)
        named = replicated_state(trainer)
        mine = fingerprints([tensor for _, tensor in named])
        gathered = [torch.empty_like(mine) for _ in members]
        dist.all_gather(gathered, mine, group=group)
        stacked = torch.stack(gathered)
        elsewhere = 0
        if dist.get_world_size() > len(members):
            # other replicate groups (HSDP's other shards, other pipeline stages or TP ranks) hold the rest of the
            # model and must roll back with this one: whether any group differs, in one all-reduce over the job,
            # read with the table
            differs = (stacked != stacked[:1]).any().to(torch.int64).reshape(1)
            dist.all_reduce(differs, op=dist.ReduceOp.MAX)
            read = torch.cat([stacked.reshape(-1), differs]).cpu().tolist()  # the one host read
            table = [read[row * mine.numel():(row + 1) * mine.numel()] for row in range(len(members))]
            elsewhere = read[-1]
        else:
            table = stacked.cpu().tolist()  # the one host read
        found = disagreement(table, members)
        if found is None:
            if elsewhere and state["snapshot"] is not None:
                roll_back_along(step, state["snapshot"], group, members)
                return
            verified(step)
            ctx.note(f"step {step.number}: {len(named)} tensors agree across {len(members)} replicas"
                     + ("; another replica group's differ and repair themselves from their majority (no snapshot "
                        "to roll back to yet)" if elsewhere else ""))
            return
        column, wrong, right = found
        differing = [index for index in range(len(table[0])) if len({row[index] for row in table}) > 1]
        last = state["verified"]
        since = f"the last verified step is {last}" if last is not None else "no step was verified before"

        what = f"step {step.number}: the replicas' {named[column][0]} differ ({len(differing)} of {len(named)} tensors)"
        sources = [majority(table, index, members) for index in differing]
        snapshot = state["snapshot"]
        if snapshot is not None:
            rollback(step, what, snapshot, sources, members)
            return
        if any(source is None for source, _ in sources):
            stop_run(f"npu_inject replica_check: {what}: {' and '.join(map(who, wrong))} disagree and no majority says "
                     f"which is wrong: drain one after checking their devices; {since}: resume from a checkpoint at "
                     "or before it")
        culprits = sorted({rank for _, wrong_ranks in sources for rank in wrong_ranks})
        for rank in culprits:
            strikes[rank] = strikes.get(rank, 0) + 1
        drained = [rank for rank in culprits if strikes[rank] >= options["stop_after"]]
        if drained:
            stop_run(f"npu_inject replica_check: {what}: {', '.join(map(who, drained))} disagreed with the majority "
                     f"{options['stop_after']} times (stop_after): drain its device; {since}")
        for index, (source, _) in zip(differing, sources):  # the majority's tensor, bit for bit, over the group
            dist.broadcast(named[index][1], src=source, group=group)
        again = [torch.empty_like(mine) for _ in members]
        dist.all_gather(again, fingerprints([tensor for _, tensor in named]), group=group)
        if disagreement(torch.stack(again).cpu().tolist(), members) is not None:
            stop_run(f"npu_inject replica_check: {what}: the replicas still differ after the majority's tensors were "
                     f"sent to {', '.join(map(who, culprits))}: drain it; {since}")
        line = (f"{what}: {', '.join(map(who, culprits))} disagreed with the majority; its tensors were replaced by "
                f"rank {', '.join(sorted({str(source) for source, _ in sources}))}'s and the replicas agree again "
                f"(strike {max(strikes[rank] for rank in culprits)} of {options['stop_after']} before it is drained); "
                f"{since}: a corruption before this step's backward averaged its gradients into every replica's "
                "updates since, which the repair does not take back")
        ctx.note(line)
        logger.warning("npu_inject replica_check: %s", line)
        verified(step)

    def compare_groups(step: Step, manager) -> None:
        import torch
        import torch.distributed as dist

        participants, mine_row = manager.num_participants(), manager.participating_rank()
        if mine_row is None or participants < 2:
            if not state["said_none"]:
                state["said_none"] = True
                ctx.note(f"step {step.number}: fewer than 2 torchft replica groups take part: nothing to compare")
            return
        named = replicated_state(step.trainer)
        mine = fingerprints([tensor for _, tensor in named])
        replica_id = str(step.trainer.config.fault_tolerance.replica_id)
        table = torch.zeros(participants, mine.numel() + 1, dtype=torch.int64, device=mine.device)
        table[mine_row, :-1] = mine
        table[mine_row, -1] = int(replica_id) if replica_id.isdigit() else -1
        manager.allreduce(table, reduce_op=dist.ReduceOp.SUM).wait()  # each row written once: the sum is a gather
        if manager.errored() is not None:
            line = (f"step {step.number}: the torchft replica groups were not compared: torchft's all-reduce failed "
                    f"({manager.errored()})")
            ctx.note(line)
            logger.warning("npu_inject replica_check: %s", line)
            return
        rows = table.cpu().tolist()  # the one host read
        names = [str(row[-1]) if row[-1] >= 0 else f"#{index}" for index, row in enumerate(rows)]
        verdict = group_verdict([row[:-1] for row in rows], mine_row, names, [name for name, _ in named])
        last = state["verified"]
        since = f"the last verified step is {last}" if last is not None else "no step was verified before"
        if verdict is None:
            state["verified"] = step.number
            unverified.clear()
            if not state["said_groups"]:
                state["said_groups"] = True
                ctx.note(f"step {step.number}: {len(named)} tensors agree across {participants} torchft replica groups")
            return
        action, why = verdict
        line = f"step {step.number}: {why}; {since} (seen on {who(dist.get_rank() if dist.is_initialized() else 0)})"
        if action == "stop":
            stop_run(f"npu_inject replica_check: {line}")
        ctx.note(line)
        logger.warning("npu_inject replica_check: %s", line)

    def rollback(step: Step, what: str, snapshot: Snapshot, sources, members) -> None:
        # the minority where there is a majority, both sides where there is none
        culprits = sorted({rank for source, wrong in sources for rank in (wrong if source is not None else members)})
        side = ("disagreed with the majority" if all(source is not None for source, _ in sources)
                else "disagree and no majority says which is wrong")
        for rank in culprits:
            strikes[rank] = strikes.get(rank, 0) + 1
        drained = [rank for rank in culprits if strikes[rank] >= options["stop_after"]]
        if drained:
            stop_run(f"npu_inject replica_check: {what}: {', '.join(map(who, drained))} {side} "
                     f"{options['stop_after']} times (stop_after): drain its device; the last verified step is "
                     f"{snapshot.step}")
        group = step.trainer.parallel_dims.get_optional_mesh("dp_replicate").get_group()
        retrained = retrain_from(step, snapshot, group, members)
        if retrained is None:
            stop_run(f"npu_inject replica_check: {what}: the replicas still differ after rolling back to step "
                     f"{snapshot.step} and training the steps since again: drain {', '.join(map(who, culprits))}; "
                     f"the last verified step is {snapshot.step}")
        line = (f"{what}: {', '.join(map(who, culprits))} {side}; every rank rolled back to step {snapshot.step} "
                f"(the last verified) and trained steps {retrained[0]}..{retrained[-1]} again on the same batches; "
                f"the replicas agree (strike {max(strikes[rank] for rank in culprits)} of {options['stop_after']} "
                "before a rank is drained)")
        ctx.note(line)
        logger.warning("npu_inject replica_check: %s", line)
        verified(step)

    def retrain_from(step: Step, snapshot: Snapshot, group, members) -> list[int] | None:
        """Put the snapshot back, train the steps since again on their batches, compare again: the steps
        retrained, or None when the replicas still differ."""
        import torch
        import torch.distributed as dist

        retrained = [number for number, _, _ in unverified]
        snapshot.restore(step.trainer)
        for number, taken, skipped in unverified:
            OWNER.retrain(step, number, taken, skipped)
        mine = fingerprints([tensor for _, tensor in replicated_state(step.trainer)])
        again = [torch.empty_like(mine) for _ in members]
        dist.all_gather(again, mine, group=group)
        return None if disagreement(torch.stack(again).cpu().tolist(), members) is not None else retrained

    def roll_back_along(step: Step, snapshot: Snapshot, group, members) -> None:
        """Another replica group's replicas differ and roll back: this group's ranks, which hold the rest of the
        model (FSDP's other shards, other stages), roll back and train the same steps again with them."""
        retrained = retrain_from(step, snapshot, group, members)
        if retrained is None:
            stop_run(f"npu_inject replica_check: step {step.number}: this replica group's replicas differ after "
                     f"rolling back with another group's to step {snapshot.step}: drain "
                     f"{', '.join(map(who, members))} after checking their devices; the last verified step is "
                     f"{snapshot.step}")
        line = (f"step {step.number}: another replica group's replicas differ (its ranks name the tensor and the "
                f"rank); every rank rolled back to step {snapshot.step} (the last verified) and trained steps "
                f"{retrained[0]}..{retrained[-1]} again on the same batches; this group's replicas agree")
        ctx.note(line)
        logger.warning("npu_inject replica_check: %s", line)
        verified(step)

    take_part(ctx, after_step=after_step)
