"""The host reads the planner marks: which the runtime makes in an NPU job, and which belong to which step."""

from types import SimpleNamespace

from npu_inject import registry, selection
from npu_inject.planner import host_reads, job


def _enabled(chosen: str = ""):
    return selection.select(registry.load(), chosen)


def _sites(reads):
    return [read.site.split(":")[0] + " " + read.where for read in reads]


def test_step_repair_reads_only_in_a_job_of_several_ranks_without_torchft():
    assert _sites(host_reads.runtime_reads(_enabled(), 2, torchft=False)) == [
        "step_repair step start", "finite_steps before the optimizer", "step_repair before the optimizer"]
    assert _sites(host_reads.runtime_reads(_enabled(), 1, torchft=False)) == ["finite_steps before the optimizer"]
    assert _sites(host_reads.runtime_reads(_enabled(), 8, torchft=True)) == ["finite_steps before the optimizer"]


def test_the_users_selection_turns_reads_off_with_their_patch():
    assert _sites(host_reads.runtime_reads(_enabled("-step_repair,-finite_steps"), 8, torchft=False)) == []


def test_a_steps_reads_are_bounded_by_its_marks_not_by_op_indices():
    """The last step's logged reads and the next step's opening mark precede the same op: each step keeps its own."""
    marks = [(0, "step 1"), (0, "host_sync: start"), (3, "host_sync: norm"), (5, "host_sync: logged"),
             (5, "reset_peaks"), (5, "step 2"), (5, "host_sync: start"), (8, "host_sync: norm"),
             (10, "host_sync: logged"), (10, "reset_peaks")]
    trace = SimpleNamespace(marks=marks)
    assert job._step_reads(trace, 2) == {5: ["start"], 8: ["norm"], 10: ["logged"]}
    assert job._step_reads(trace, 1) == {0: ["start"], 3: ["norm"], 5: ["logged"]}
