"""A middle pipeline stage's recording standing for its like (npu_inject.planner.stages).

The order written out is held against torch's own statement of the 1F1B order; the reordering itself is held
against a real recording of the other stage in tests/e2e/test_plan.py (a recording takes seconds).
"""

from __future__ import annotations

import pytest

from npu_inject.planner import stages
from npu_inject.planner.job import _stage_list
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
    assert _stage_list([3, 4, 5, 6]) == "3-6"
    assert _stage_list([2, 3]) == "2, 3"
    assert _stage_list([6, 3, 4, 5, 9]) == "3-6 and 9"
