"""A pipeline's recordings evaluated once per profile: another microbatch count is another point on their line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from npu_inject.planner import job


def test_another_microbatch_count_of_the_same_recordings_is_not_replayed_again(monkeypatch):
    replayed, lines = [], []
    monkeypatch.setattr(job, "_evaluate", lambda roles, **kwargs: replayed.append(roles) or ("plan", roles))
    monkeypatch.setattr(job, "_more_microbatches", lambda fewer, more, counts: lines.append(counts) or counts)
    recording = job.Recording(["--module", "llama3"], 8, (None,), [{0: "fewer"}, {0: "more"}], 1.0, (8, 16, 512))
    profile, other = SimpleNamespace(name="A2"), SimpleNamespace(name="A3")
    assert job.evaluate(recording, profile=profile, efficiency={"overhead": 0.1}) == (8, 16, 512)
    assert job.evaluate_microbatches(recording, 256, profile=profile, efficiency={"overhead": 0.1}) == (8, 16, 256)
    assert len(replayed) == 2 and lines == [(8, 16, 512), (8, 16, 256)]  # the two counts replayed once
    job.evaluate(recording, profile=other, efficiency={"overhead": 0.1})  # another profile: replayed for it
    job.evaluate(recording, profile=profile, efficiency={"overhead": 0.2})  # another efficiency: likewise
    assert len(replayed) == 6


def test_a_timing_extrapolated_lies_on_the_line_through_two_with_waits_and_counts_no_lower_than_0():
    from npu_inject.planner import costmodel, depth

    shallow = costmodel.Timing(step_s=1.0, compute_s=0.5, comm_s={"all_gather": 0.2}, host_wait_s=0.3,
                               waited_by_group_s={"tp all_gather": 0.2}, host_reads={"loss": 2}, kernels=10)
    deeper = costmodel.Timing(step_s=2.0, compute_s=1.0, comm_s={"all_gather": 0.3}, host_wait_s=0.1,
                              waited_by_group_s={"tp all_gather": 0.1}, host_reads={"loss": 1}, kernels=20)
    timing = job._timing_along(shallow, deeper, lambda a, b: depth.extrapolate(a, b, (1, 2), 4),
                               by_module={"layers.0": 9.0})
    assert (timing.step_s, timing.compute_s, timing.kernels) == (4.0, 2.0, 40)
    assert timing.comm_s == {"all_gather": pytest.approx(0.5)}
    assert (timing.host_wait_s, timing.waited_by_group_s, timing.host_reads) == (0.0, {"tp all_gather": 0.0},
                                                                                  {"loss": 0})
    assert timing.by_module == {"layers.0": 9.0}  # given as it is
    assert timing.exposed_comm_s == pytest.approx(2.0)  # settled: the step less compute
