"""A middle pipeline stage's recording standing for its like (npu_inject.planner.stages).

The order written out is held against torch's own statement of the 1F1B order; the reordering itself is held
against a real recording of the other stage in tests/e2e/test_plan.py (a recording takes seconds).
"""

from __future__ import annotations

import pytest

from npu_inject.planner import stages
from npu_inject.planner.trace import Trace


def _torch_order(stage: int, pp: int, microbatches: int) -> list[tuple[str, int]]:
    from torch.distributed.pipelining.schedules import Schedule1F1B, _ComputationType

    schedule = object.__new__(Schedule1F1B)  # its order needs the counts alone, not stages
    schedule._num_stages, schedule._n_microbatches = pp, microbatches
    names = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(names[action.computation_type], action.microbatch_index)
            for action in schedule._get_pipeline_order()[stage]
            if action is not None and action.computation_type in names]


@pytest.mark.parametrize("pp, microbatches", [(4, 4), (4, 8), (8, 16), (8, 24), (5, 7)])
def test_the_written_out_order_of_forwards_and_backwards_is_torchs(pp, microbatches):
    # torch 2.14's statement numbers the last stage's forwards from 1 (its counter is raised before the first
    # forward when there is no warm-up); the order it runs, _step_microbatches, does not: that stage is left out.
    for stage in range(pp - 1):
        ours = [part for part in stages.one_f_one_b(stage, pp, microbatches) if part[0] != "p2p"]
        assert ours == _torch_order(stage, pp, microbatches), stage


def test_every_send_and_receive_of_a_middle_stage_is_issued_once_and_before_its_use():
    parts = stages.one_f_one_b(2, 8, 16)
    issued = [label for kind, value in parts if kind == "p2p" for label in value]
    for direction in ("fwd_recv", "fwd_send", "bwd_recv", "bwd_send"):
        assert sorted(i for d, i in issued if d == direction) == list(range(16))
    position = {label: n for n, label in enumerate(
        (label for kind, value in parts for label in (value if kind == "p2p" else [(kind, value)])))}
    for i in range(16):
        assert position[("fwd_recv", i)] < position[("F", i)] < position[("fwd_send", i)]
        assert position[("bwd_recv", i)] < position[("B", i)] < position[("bwd_send", i)]


def test_the_first_and_last_stages_exchange_with_one_neighbour_only():
    assert not any(d in ("fwd_recv", "bwd_send") for kind, value in stages.one_f_one_b(0, 4, 8) if kind == "p2p"
                   for d, _ in value)
    assert not any(d in ("fwd_send", "bwd_recv") for kind, value in stages.one_f_one_b(3, 4, 8) if kind == "p2p"
                   for d, _ in value)


def test_middle_stages_of_one_kind_share_the_first_ones_recording():
    kinds = ["embed", "a", "b", "b", "b", "b", "b", "out"]
    facts = {"pp": 8, "stage_kinds": kinds, "pp_schedule": "1F1B"}
    assert stages.donors(facts) == {3: 2, 4: 2, 5: 2, 6: 2}
    assert stages.donors({**facts, "pp_schedule": "Interleaved1F1B"}) == {}  # another order: every stage recorded
    assert stages.donors({**facts, "pp": 4}) == {}  # kinds of another layout (the search's)
    assert stages.donors({"pp": 4, "stage_kinds": ["e", "a", "a", "o"], "pp_schedule": "1F1B"}) == {2: 1}
    assert stages.donors({"pp": 3, "stage_kinds": ["e", "a", "o"], "pp_schedule": "1F1B"}) == {}


def test_a_recording_without_its_order_or_a_schedule_run_is_refused_with_the_reason():
    with pytest.raises(stages.NotShareable, match="kept no order"):
        stages.as_stage(Trace(), donor=1, stage=2, stages=4, ranks_per_stage=1)
    with pytest.raises(stages.NotShareable, match="no marked 1F1B schedule run"):
        stages.as_stage(Trace(events=[]), donor=1, stage=2, stages=4, ranks_per_stage=1)
    with pytest.raises(stages.NotShareable, match="only middle stages"):
        stages.as_stage(Trace(events=[]), donor=1, stage=3, stages=4, ranks_per_stage=1)


def test_stage_lists_read_as_ranges():
    assert stages.stage_list([3, 4, 5, 6]) == "3-6"
    assert stages.stage_list([2, 3]) == "2, 3"
    assert stages.stage_list([6, 3, 4, 5, 9]) == "3-6 and 9"


def _recorded(parts, stage: int, pp: int) -> Trace:
    """A trace as the recorder would leave it for ``parts`` (one_f_one_b's form) on ``stage``: each forward makes
    an activation its backward frees; each send or receive is one op with the pipeline group (1 rank per stage)."""
    from npu_inject.planner.trace import ALLOCATED, FREED, MARK, OP, Allocation, Op

    trace = Trace(events=[])
    activations: dict[int, int] = {}

    def mark(text):
        trace.marks.append((len(trace.ops), text))
        trace.events.append((MARK, len(trace.marks) - 1))

    def op(name, **fields):
        trace.ops.append(Op(len(trace.ops), name, fields.pop("kind", "compute"), 1.0, 8, "bfloat16", "forward", 0,
                            fields.pop("module", ""), (), (), **fields))
        trace.events.append((OP, len(trace.ops) - 1))

    mark(stages.SCHEDULE)
    for kind, value in parts:
        if kind == "p2p":
            mark(stages.P2P)
            for direction, _ in value:
                peer = stage - 1 if direction in ("fwd_recv", "bwd_send") else stage + 1
                op("c10d." + direction.split("_")[1], kind="collective", collective=direction.split("_")[1],
                   group=tuple(range(pp)), peer=peer)
            mark(stages.PART_END)
            continue
        mark(f"{stages.FORWARD if kind == 'F' else stages.BACKWARD} {value}")
        if kind == "F":
            trace.allocations.append(Allocation(len(trace.allocations), 100, 0, len(trace.ops), "forward"))
            activations[value] = len(trace.allocations) - 1
            trace.events.append((ALLOCATED, activations[value]))
        op("aten.mm", module=f"layers.{stage}.feed_forward")
        if kind == "B":
            trace.allocations[activations[value]].freed = len(trace.ops)
            trace.events.append((FREED, activations[value]))
        mark(stages.PART_END)
    mark(stages.PART_END)
    return trace


def test_a_recorded_order_is_laid_out_in_the_other_stages_order_with_its_peers_and_layers_moved():
    donor = _recorded(stages.one_f_one_b(1, 4, 6), 1, 4)
    copy = stages.as_stage(donor, donor=1, stage=2, stages=4, ranks_per_stage=1, layer_offset=1)
    expected = _recorded(stages.one_f_one_b(2, 4, 6), 2, 4)
    assert [(op.name, op.group, op.peer, op.module) for op in copy.ops] == [
        (op.name, op.group, op.peer, op.module) for op in expected.ops]
    # Each activation lives from its forward to its backward, as the stage's own order places them.
    assert sorted((a.op, a.freed) for a in copy.allocations) == sorted((a.op, a.freed) for a in expected.allocations)
    def parts(trace):  # a batch's marks go with its sends and receives, which the other order batches anew
        return [(index, text) for index, text in trace.marks if text.startswith((stages.FORWARD, stages.BACKWARD))]

    assert parts(copy) == parts(expected)


def test_a_recorded_order_other_than_the_written_out_one_is_refused():
    parts = stages.one_f_one_b(1, 4, 6)
    first, second = [n for n, part in enumerate(parts) if part[0] == "F"][:2]
    parts[first], parts[second] = parts[second], parts[first]
    with pytest.raises(stages.NotShareable, match="does not follow torch's 1F1B"):
        stages.as_stage(_recorded(parts, 1, 4), donor=1, stage=2, stages=4, ranks_per_stage=1)


def test_a_stage_whose_donor_cannot_be_reordered_is_said_and_recorded_after_all():
    import concurrent.futures

    from npu_inject.planner import job
    from npu_inject.planner.session import RoleResult

    submitted = []

    class Pool:  # records nothing: each "recording" is a trace without its order of events
        def submit(self, function, argv, world_size, rank, units, microbatches):
            submitted.append(rank)
            future = concurrent.futures.Future()
            future.set_result(RoleResult(rank, world_size, Trace(), {}))
            return future

    facts = {"pp": 4, "microbatch_size": 1, "local_batch_size": 4, "global_batch_size": 4, "dp": 1,
             "pp_schedule": "1F1B", "stage_kinds": ["e", "a", "a", "o"], "stage_first_layers": [-1, 0, 2, 4]}
    lines: list[str] = []
    pending = job.Pending(["--module", "llama3"], 4, (None,), Pool(), 4, lines.append, facts)
    assert submitted == [0, 1, 3] and "stage 1's recording reordered for stage 2" in lines[0]
    recording = pending.result()
    assert submitted == [0, 1, 3, 2]
    assert sorted(recording.roles[0]) == [0, 1, 2, 3] and recording.roles[0][2].rank == 2
    assert any(line.startswith("stage 2 recorded after all: the donor's recording could not be reordered (the "
                               "donor's recording kept no order of events)") for line in lines), lines
    assert recording.reordered == {}  # planned as recorded: the plan does not say it was reordered


def test_a_plan_says_which_stages_were_planned_from_another_stages_recording():
    from types import SimpleNamespace

    from npu_inject.planner import render

    plan = SimpleNamespace(info={"stages_reordered": {3: 2, 4: 2, 5: 2, 6: 2}}, extrapolated=None,
                           parallel={"pp": 8, "ep": 1}, roles=[])
    assert ("pipeline stages 3-6 planned from stage 2's recording, reordered as their 1F1B schedule runs its parts "
            "(npu_inject/planner/stages.py)") in render.notes(plan)
