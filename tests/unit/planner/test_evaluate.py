"""A pipeline's recordings evaluated once per profile: another microbatch count is another point on their line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from npu_inject.planner import job


def test_another_microbatch_count_of_the_same_recordings_is_not_replayed_again(monkeypatch):
    replayed, lines = [], []
    monkeypatch.setattr(job, "_evaluate", lambda roles, **kwargs: replayed.append(roles) or ("plan", roles))
    monkeypatch.setattr(job, "_more_microbatches", lambda fewer, more, counts, caches: lines.append(counts) or counts)
    monkeypatch.setattr(job, "_held_caches", lambda recorded, plan, profile, expandable, count: {0: count})
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


def test_more_microbatches_take_the_allocated_peak_on_the_line_and_the_cache_given():
    """16 and 24 microbatches recorded, 64 planned: the allocated peak on the line through the two (10 and 11 GiB:
    16 GiB at 64); the cache beyond it the one given (the recording replayed holding 64's buffers), not the
    fewer's (2 GiB) or the more's (4 GiB)."""
    from npu_inject.planner import costmodel

    gib = 2**30

    def plan(allocated, reserved, count):
        role = job.RolePlan(0, 0, allocated * gib, reserved * gib, 0, 0, {}, [], 1)
        return job.JobPlan(["--module", "llama3"], "A2", 8, {"pp": 8}, [role], costmodel.Timing(step_s=count),
                           count * 8192, 64 * gib, {"pp_microbatches": count, "local_batch_size": count,
                                                   "global_batch_size": count})

    planned = job._more_microbatches(plan(10, 12, 16), plan(11, 15, 24), (16, 24, 64), {0: gib})
    assert planned.roles[0].peak_allocated == 16 * gib
    assert planned.roles[0].peak_reserved == 17 * gib
    assert planned.step_s == pytest.approx(64.0) and planned.info["pp_microbatches"] == 64


def test_a_recording_replayed_as_built_holds_the_first_schedules_buffers_repeated_and_none_of_the_later():
    """Warm-up built for 2 microbatches (buffers 1, 2, freed at the rebuild), the fewer's 3 (ids 4-6), the more's
    (7): as a job of 6 microbatches, 1 and 2 kept, two copies of each made where they were, 4-7 never made."""
    from npu_inject.planner import memory
    from npu_inject.planner.trace import Allocation, Op, Trace

    mib = 2**20
    ops = [Op(i, "aten.add", "compute", 0.0, 0, "bf16", "forward", 0, "", (), ()) for i in range(25)]
    trace = Trace(ops=ops, allocations=[
        Allocation(0, 100 * mib, 0, -1, "setup"),  # parameters
        Allocation(1, 16 * mib, 0, 1, "forward", freed=10), Allocation(2, 16 * mib, 0, 1, "forward", freed=10),
        Allocation(3, 64 * mib, 0, 5, "forward", freed=6),  # an activation
        *(Allocation(i, 16 * mib, 0, 11, "forward", freed=20) for i in (4, 5, 6)),
        Allocation(7, 16 * mib, 0, 21, "forward")])
    built = job._as_built_for(trace, [(2, [1, 2]), (3, [4, 5, 6]), (4, [7])], 6)
    by_id = {allocation.id: allocation for allocation in built.allocations}
    assert sorted(by_id) == [-4, -3, -2, -1, 0, 1, 2, 3]
    assert all(by_id[i].freed is None and by_id[i].op == 1 and by_id[i].nbytes == 16 * mib
               for i in (-4, -3, -2, -1, 1, 2))
    assert by_id[3] == trace.allocations[3]
    replayed = memory.replay(built, pad=32, expandable=False, device_memory=2**30)
    assert replayed.peak_allocated == pytest.approx((100 + 6 * 16 + 64) * mib, abs=mib)  # six buffers, not nine


def test_two_mesh_dimensions_over_the_same_ranks_are_two_communicators():
    """Each process group is an HCCL communicator with buffers of its own, whatever ranks it shares."""
    from types import SimpleNamespace as Op

    ops = [Op(kind="collective", collective="all_gather", group=(0, 8), mesh="dp_shard_cp", peer=None),
           Op(kind="collective", collective="all_gather", group=(0, 8), mesh="cp", peer=None),
           Op(kind="collective", collective="reduce_scatter", group=(0, 8), mesh="cp", peer=None),
           Op(kind="collective", collective="send", group=(0, 1), mesh="pp", peer=1)]
    assert job._communicators(SimpleNamespace(ops=ops)) == (2, 1)
