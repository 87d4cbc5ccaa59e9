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


def test_more_microbatches_take_the_allocated_peak_on_the_line_and_the_cache_as_the_fewer_left_it():
    """16 and 24 microbatches recorded, 64 planned: the allocated peak on the line through the two (10 and 11 GiB:
    16 GiB at 64); the cache beyond it the fewer's (2 GiB), not the more's (4 GiB, after a second rebuild)."""
    from npu_inject.planner import costmodel

    gib = 2**30

    def plan(allocated, reserved, count):
        role = job.RolePlan(0, 0, allocated * gib, reserved * gib, 0, 0, {}, [], 1)
        return job.JobPlan(["--module", "llama3"], "A2", 8, {"pp": 8}, [role], costmodel.Timing(step_s=count),
                           count * 8192, 64 * gib, {"pp_microbatches": count, "local_batch_size": count,
                                                   "global_batch_size": count})

    planned = job._more_microbatches(plan(10, 12, 16), plan(11, 15, 24), (16, 24, 64))
    assert planned.roles[0].peak_allocated == 16 * gib
    assert planned.roles[0].peak_reserved == 18 * gib
    assert planned.step_s == pytest.approx(64.0) and planned.info["pp_microbatches"] == 64
