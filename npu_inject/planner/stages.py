"""One middle pipeline stage's recording standing for its like: the same parts laid out in another stage's order.

In a 1F1B pipeline the middle stages that hold alike modules (llama3_70b on 8 stages: stages 2 to 6, ten layers
each) run the same forward and backward per microbatch on equal shards. They differ in three things only: the
order in which torch's schedule runs those parts (a stage warms up with one forward per stage from it to the end),
the neighbours they send to and receive from, and the ranks of their groups. Recordings of full depth are the
planner's cost, so one of them (the donor) is recorded and each of the others is its recording reordered.

The recording keeps the order in which everything happened (``Trace.events``), and the planner marks each part of
torch's ``Schedule1F1B._step_microbatches``: a microbatch's forward, its backward, a batch of sends and receives
(:mod:`npu_inject.planner.interventions`). :func:`as_stage` cuts each of the donor's schedule runs into those
parts (what runs between two parts goes with the one before), names every send and receive by direction and
microbatch, checks that :func:`one_f_one_b` gives the donor's own order back, and lays the parts out in the other
stage's order: the ops renumbered, every allocation and free where its part now runs, the groups' ranks those of
the other stage. Anything it cannot account for raises :class:`NotShareable`, and that stage is recorded instead.

What it assumes: a part's work and memory do not depend on when it runs. That holds for what is recorded (fake
tensors compute nothing; the same requests reach the allocator model in the other order). The reordered stage's
first and last parts, its optimizer step and everything outside the schedule are the donor's as they were.
``python tools/bench_plan.py stages`` holds it against recording every stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The marks the planner puts around a 1F1B schedule's parts (each part ends with PART_END).
SCHEDULE = "pipeline schedule"
FORWARD = "pipeline F"
BACKWARD = "pipeline B"
P2P = "pipeline p2p"
PART_END = "pipeline end"

# The schedule whose order :func:`one_f_one_b` writes out (torchtitan's --parallelism.pipeline_parallel_schedule).
SCHEDULES = ("1F1B",)


class NotShareable(Exception):
    """The donor's recording cannot stand for the stage: why, in one line."""


def stage_facts(config) -> dict[str, list]:
    """What each pipeline stage of ``config``'s job holds, for :func:`config.describe`: ``stage_kinds``, its modules
    other than layers and the kind of each layer (:func:`npu_inject.planner.depth._kind`; stages of one kind run the
    same work), and ``stage_first_layers``, the index of its first layer (-1 for a stage without layers)."""
    from npu_inject.planner import depth

    shape = depth.shape(config)
    if shape is None:
        return {"stage_kinds": [], "stage_first_layers": []}
    layers = config.model_spec.model.layers
    kinds, firsts = [], []
    for names in shape.stages:
        others = tuple(name for name in names if not name.startswith("layers."))
        held = [int(name.split(".")[1]) for name in names if name.startswith("layers.")]
        kinds.append(repr((others, tuple(depth._kind(layers[index]) for index in held))))
        firsts.append(min(held, default=-1))
    return {"stage_kinds": kinds, "stage_first_layers": firsts}


def donors(facts: dict[str, Any]) -> dict[int, int]:
    """{stage: the stage whose recording stands for it} for the job ``facts`` describe (:func:`config.describe`'s):
    each middle stage whose kind an earlier middle stage has, with the single-stage 1F1B schedule. Empty when
    nothing is shared."""
    pp, kinds = facts.get("pp", 1), facts.get("stage_kinds") or []
    if pp < 4 or len(kinds) != pp or facts.get("pp_schedule") not in SCHEDULES:
        return {}
    first_of: dict[str, int] = {}
    shared = {}
    for stage in range(1, pp - 1):
        donor = first_of.setdefault(kinds[stage], stage)
        if donor != stage:
            shared[stage] = donor
    return shared


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple]:
    """The parts of torch's ``Schedule1F1B._step_microbatches`` for ``stage`` in order: ``("F", i)``, ``("B", i)``
    and ``("p2p", [(direction, i), ...])`` for each batch of sends and receives it issues (empty ones left out);
    directions ``fwd_recv``, ``fwd_send``, ``bwd_recv``, ``bwd_send``."""
    first, last = stage == 0, stage == stages - 1
    parts: list[tuple] = []

    def batch(*labels):
        labels = [label for group in labels for label in group]
        if labels:
            parts.append(("p2p", labels))

    def fwd_recv(i):
        return [] if first else [("fwd_recv", i)]

    def fwd_send(i):
        return [] if last else [("fwd_send", i)]

    def bwd_recv(i):
        return [] if last else [("bwd_recv", i)]

    def bwd_send(i):
        return [] if first else [("bwd_send", i)]

    warmup = min(microbatches, stages - stage)
    forward = backward = 0
    sends: list = []
    for _ in range(warmup):
        batch(fwd_recv(forward))
        parts.append(("F", forward))
        sends = fwd_send(forward)
        if forward != warmup - 1:
            batch(sends)  # the last warm-up send waits to go with the first backward's receive
        forward += 1
    while True:
        batch(sends, bwd_recv(backward))
        parts.append(("B", backward))
        backward_sends = bwd_send(backward)
        backward += 1
        if forward == microbatches:
            break
        batch(backward_sends, fwd_recv(forward))
        parts.append(("F", forward))
        sends = fwd_send(forward)
        forward += 1
    batch(backward_sends)
    while backward < microbatches:
        batch(bwd_recv(backward))
        parts.append(("B", backward))
        batch(bwd_send(backward))
        backward += 1
    return parts


def stage_list(numbers: list[int]) -> str:
    """[3, 4, 5, 6, 9] -> "3-6 and 9"."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    texts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + " and " + texts[-1]


@dataclasses.dataclass
class _Part:
    label: tuple  # ("F", i), ("B", i) or ("p2p", None)
    events: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Run:
    """One call of the schedule: what it did before its first part, its parts, what it did after its last."""
    prefix: list
    parts: list
    suffix: list


def _parse_part(text: str) -> tuple | None:
    for prefix, kind in ((FORWARD + " ", "F"), (BACKWARD + " ", "B")):
        if text.startswith(prefix):
            return (kind, int(text[len(prefix):]))
    return ("p2p", None) if text == P2P else None


def _regions(trace) -> list:
    """The trace's events as a list of plain events and schedule runs (:class:`_Run`)."""
    from npu_inject.planner.trace import MARK

    out: list = []
    region: _Run | None = None
    inside_part = False
    between: list = []  # since the last part ended: the next part's predecessor's, or the run's end
    for event in trace.events:
        text = trace.marks[event[1]][1] if event[0] == MARK else None
        if region is None:
            if text == SCHEDULE:
                region, between = _Run([event], [], []), []
            else:
                out.append(event)
        elif inside_part:
            region.parts[-1].events.append(event)
            if text == PART_END:
                inside_part = False
            elif text is not None and (text == SCHEDULE or _parse_part(text) is not None):
                raise NotShareable(f"a pipeline part began inside another ({text!r})")
        elif text is not None and _parse_part(text) is not None:
            # What ran between two parts goes with the one before (before the first: the run's start).
            (region.parts[-1].events if region.parts else region.prefix).extend(between)
            region.parts.append(_Part(_parse_part(text), [event]))
            between, inside_part = [], True
        elif text == PART_END:  # the run ends: what ran after its last part stays last
            region.suffix.extend([*between, event])
            out.append(region)
            region = None
        else:
            between.append(event)
    if region is not None:
        raise NotShareable("a pipeline schedule run was not closed")
    return out


def _tokens(trace, region: _Run, stage: int, ranks_per_stage: int) -> tuple[list, dict]:
    """A schedule run's parts as :func:`one_f_one_b` names them, and the events of each: ``{("F", i): events,
    ("fwd_recv", i): events, ...}`` (a send or receive with the events up to the next)."""
    from npu_inject.planner.trace import OP

    parts = region.parts
    microbatches = sum(1 for part in parts if part.label[0] == "F")
    if not microbatches:
        raise NotShareable("a schedule run without a forward")
    directions = {("recv", stage - 1): "fwd_recv", ("send", stage + 1): "fwd_send",
                  ("recv", stage + 1): "bwd_recv", ("send", stage - 1): "bwd_send"}
    per_direction: dict[str, list[list]] = {}
    order: list[tuple] = []
    leftover: list = []  # a batch's events before its first op, or a batch without ops: with what follows
    for part in parts:
        if part.label[0] != "p2p":
            order.append(part.label)
            per_direction.setdefault(part.label, []).append(leftover + part.events)
            leftover = []
            continue
        batch = []
        current: list | None = None
        for event in part.events:
            if event[0] != OP:
                (current if current is not None else leftover).append(event)
                continue
            op = trace.ops[event[1]]
            if op.collective not in ("send", "recv") or op.peer is None or not op.group:
                raise NotShareable(f"op {event[1]} ({op.name}) in a batch of sends and receives is neither")
            direction = directions.get((op.collective, op.group[op.peer] // ranks_per_stage))
            if direction is None:
                raise NotShareable(f"op {event[1]}: a {op.collective} with rank {op.group[op.peer]}, not a neighbour "
                                   f"of stage {stage}")
            current = leftover + [event]
            leftover = []
            per_direction.setdefault(direction, []).append(current)
            batch.append(direction)
        if batch:
            order.append(("p2p", batch))
    if leftover:
        raise NotShareable("a schedule run ends with a batch of sends and receives that issued nothing")
    events: dict[tuple, list] = {}
    for key, pieces in per_direction.items():
        if key[0] in ("F", "B"):
            events[key] = pieces[0]
            continue
        if len(pieces) % microbatches:
            raise NotShareable(f"{len(pieces)} {key} ops for {microbatches} microbatches")
        each = len(pieces) // microbatches
        for i in range(microbatches):
            events[(key, i)] = [event for piece in pieces[i * each:(i + 1) * each] for event in piece]
    # The batches as labelled, each label once per microbatch however many tensors it sends.
    named, counters = [], {}
    for kind, value in order:
        if kind != "p2p":
            named.append((kind, value))
            continue
        labels = []
        for direction in value:
            index = counters.get(direction, 0)
            counters[direction] = index + 1
            label = (direction, index // (len(per_direction[direction]) // microbatches))
            if not labels or labels[-1] != label:
                labels.append(label)
        named.append(("p2p", labels))
    return named, events


def as_stage(trace, *, donor: int, stage: int, stages: int, ranks_per_stage: int, layer_offset: int = 0):
    """``trace`` (the recording of pipeline stage ``donor``) as stage ``stage`` would have recorded it: a new Trace
    (module docstring), its layers named ``layer_offset`` further on. Raises :class:`NotShareable` with the reason
    when it cannot."""
    from npu_inject.planner.trace import ALLOCATED, MARK, OP, Trace

    if trace.events is None:
        raise NotShareable("the donor's recording kept no order of events")
    if not (0 < donor < stages - 1 and 0 < stage < stages - 1):
        raise NotShareable(f"stages {donor} and {stage}: only middle stages stand for each other")
    emitted: list = []
    runs = 0
    for item in _regions(trace):
        if not isinstance(item, _Run):
            emitted.append(item)
            continue
        runs += 1
        named, events = _tokens(trace, item, donor, ranks_per_stage)
        microbatches = sum(1 for kind, _ in named if kind == "F")
        expected = one_f_one_b(donor, stages, microbatches)
        if named != expected:
            raise NotShareable(f"the donor's schedule run {runs} does not follow torch's 1F1B as written out here "
                               f"(stage {donor}, {microbatches} microbatches)")
        emitted.extend(item.prefix)
        used = set()
        for kind, value in one_f_one_b(stage, stages, microbatches):
            for key in (value if kind == "p2p" else [(kind, value)]):
                emitted.extend(events[key])
                used.add(key)
        if used != set(events):
            raise NotShareable(f"schedule run {runs}: parts {sorted(set(events) - used)[:3]} not placed")
        emitted.extend(item.suffix)
    if runs == 0:
        raise NotShareable("the donor's recording has no marked 1F1B schedule run")
    if len(emitted) != len(trace.events):
        raise NotShareable(f"{len(trace.events)} events recorded, {len(emitted)} laid out")

    shift = (stage - donor) * ranks_per_stage
    block = range(donor * ranks_per_stage, (donor + 1) * ranks_per_stage)
    groups: dict[tuple, tuple] = {}

    def moved(group: tuple) -> tuple:
        if group not in groups:  # a group inside the donor's stage moves; one across the stages stays
            groups[group] = tuple(rank + shift for rank in group) if all(rank in block for rank in group) else group
        return groups[group]

    names: dict[str, str] = {}

    def renamed(module: str) -> str:
        if module not in names:
            parts = module.split(".")
            if layer_offset and len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
                parts[1] = str(int(parts[1]) + layer_offset)
            names[module] = ".".join(parts)
        return names[module]

    new = Trace(events=[])
    allocations = [dataclasses.replace(allocation) for allocation in trace.allocations]
    for kind, key in emitted:
        position = len(new.ops)
        if kind == OP:
            op = trace.ops[key]
            changes: dict[str, Any] = {"index": position, "module": renamed(op.module)}
            if op.group:
                if op.collective in ("send", "recv") and op.peer is not None:
                    peer_rank = op.group[op.peer] + shift
                    group = op.group if peer_rank in op.group else tuple(rank + shift for rank in op.group)
                    changes.update(group=group, peer=group.index(peer_rank))
                else:
                    changes["group"] = moved(op.group)
            new.ops.append(dataclasses.replace(op, **changes))
            new.events.append((OP, position))
        elif kind == MARK:
            new.marks.append((position, trace.marks[key][1]))
            new.events.append((MARK, len(new.marks) - 1))
        elif kind == ALLOCATED:
            if allocations[key].op >= 0:
                allocations[key].op = position
            new.events.append((kind, key))
        else:
            allocations[key].freed = position
            new.events.append((kind, key))
    new.allocations = allocations
    for allocation in allocations:
        if allocation.freed is not None and allocation.op >= 0 and allocation.freed < allocation.op:
            raise NotShareable(f"allocation {allocation.id} would be freed (before op {allocation.freed}) before it is "
                               f"made (op {allocation.op}) in stage {stage}'s order")
    return new
