"""Replicas whose parameters or optimizer states drift apart are caught on checked steps, naming the rank and tensor.

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
and reads the table back once. Where they differ, the tensor is named, and with three or more replicas the
majority says which rank is wrong; with two, both are named. Every rank stops with one line: the step, the
tensor, the rank(s) to drain with their host and device, and the last verified step (resume from a checkpoint
at or before it). Each verified step is noted in the report. Rolling back to the last verified state in the
job is not built yet: the stop is loud, never a silent train-on.

Cost per checked step: one read of every parameter and optimizer state on the device (the sums: about the
bytes of the weights and Adam's two moments), one all-gather of one int64 per tensor over the replicate group,
one device-to-host copy of the gathered table. Nothing on other steps. torchft replica groups (no replicate
dimension inside torchtitan) are not compared yet.
"""

from __future__ import annotations

import socket

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.training_step import Step, take_part

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)


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
    for optimizer in getattr(trainer.optimizers, "optimizers", [trainer.optimizers]):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                for key, value in sorted(optimizer.state.get(parameter, {}).items()):
                    if isinstance(value, torch.Tensor):
                        named.append((f"{names_of.get(id(parameter), '?')} (optimizer {key})", local(value)))
    return named


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
        values = [row[column] for row in table]
        if len(set(values)) == 1:
            continue
        counts = {value: values.count(value) for value in set(values)}
        value, most = max(counts.items(), key=lambda item: item[1])
        if most * 2 > len(values):
            wrong = [rank for rank, each in zip(members, values) if each != value]
            right = [rank for rank, each in zip(members, values) if each == value]
            return column, wrong, right
        return column, list(members), []
    return None


def apply(ctx: PatchContext) -> None:
    every = ctx.options["every"]  # registry.json's option_rules keep it >= 1
    state = {"verified": None, "where": None, "said_none": False}

    def after_step(step: Step) -> None:
        if step.number % every:
            return
        import torch
        import torch.distributed as dist

        trainer = step.trainer
        mesh = trainer.parallel_dims.get_optional_mesh("dp_replicate")
        if mesh is None:
            if not state["said_none"]:
                state["said_none"] = True
                ctx.note("no replicate dimension (--parallelism.data_parallel_replicate_degree 1): nothing to compare")
            return
        group = mesh.get_group()
        members = dist.get_process_group_ranks(group)
        if state["where"] is None:  # each member's host and device, once
            where = [None] * len(members)
            dist.all_gather_object(where, (socket.gethostname(), str(trainer.device)), group=group)
            state["where"] = where
        named = replicated_state(trainer)
        mine = fingerprints([tensor for _, tensor in named])
        gathered = [torch.empty_like(mine) for _ in members]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).cpu().tolist()  # the one host read
        found = disagreement(table, members)
        if found is None:
            state["verified"] = step.number
            ctx.note(f"step {step.number}: {len(named)} tensors agree across {len(members)} replicas")
            return
        column, wrong, right = found
        differing = sum(len({row[index] for row in table}) > 1 for index in range(len(table[0])))

        def who(rank: int) -> str:
            host, device = state["where"][members.index(rank)]
            return f"rank {rank} ({host}, {device})"

        verdict = (f"{', '.join(map(who, wrong))} disagree{'s' if len(wrong) == 1 else ''} with the majority "
                   f"({', '.join(map(str, right))}): drain {'its device' if len(wrong) == 1 else 'their devices'}"
                   if right else
                   f"{' and '.join(map(who, wrong))} disagree and no majority says which is wrong (two replicas): "
                   "drain one after checking both devices")
        last = state["verified"]
        stop_run(f"npu_inject replica_check: step {step.number}: the replicas' {named[column][0]} differ "
                 f"({differing} of {len(named)} tensors differ): {verdict}; the last verified step is "
                 f"{last if last is not None else 'none (no earlier check)'}: resume from a checkpoint at or before "
                 "it (rolling back in the job is not built)")

    take_part(ctx, after_step=after_step)
