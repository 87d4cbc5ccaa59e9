"""The ranks' agreement on a device fault (npu_inject/repair_channel.py, step_repair's decisions), on torch's HashStore.

The repairs themselves (stop, restart, communicators made anew, the step retried on every rank) run on the real
torch_npu over the CANN emulation: tests/cann_emu/test_step_repair.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from npu_inject.repair_channel import RepairChannel, Watcher


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.HashStore()


def fault(rank: int, kind: str = "collective", step: int = 3) -> dict:
    return {"rank": rank, "step": step, "attempt": 0, "kind": kind, "why": f"{kind} on {rank}"}


def test_the_first_fault_published_stands_and_later_ones_read_it(store):
    first, second = RepairChannel(store, 0, 2), RepairChannel(store, 1, 2)
    assert first.standing() is None
    assert first.publish(fault(0)) == fault(0)
    assert second.publish(fault(1, "stopped")) == fault(0)  # rank 1's stop came from rank 0's fault
    assert second.standing() == fault(0)
    second.generation = 1  # a repair later: a new fault stands on its own
    assert second.publish(fault(1, "uce", step=7)) == fault(1, "uce", step=7)


def test_every_rank_reads_every_report_and_a_silent_rank_is_named(store):
    channels = [RepairChannel(store, rank, 3) for rank in range(3)]
    results = {}

    def report(rank: int) -> None:
        results[rank] = channels[rank].reports({"step": 3, "problem": ""}, timeout_s=5)

    threads = [threading.Thread(target=report, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    channels[2].reports({"step": 3, "problem": "a UCE in the job's state"}, timeout_s=5)
    for thread in threads:
        thread.join()
    reports, missing = results[0]
    assert missing == [] and results[1] == results[0]
    assert reports[2]["problem"] == "a UCE in the job's state"
    lonely = RepairChannel(store, 0, 2)
    lonely.generation = 1
    started = time.monotonic()
    reports, missing = lonely.reports({"step": 3, "problem": ""}, timeout_s=0.5)
    assert missing == [1] and list(reports) == [0] and time.monotonic() - started < 5


def test_the_first_verdict_stands_for_a_rank_that_reports_late(store):
    early, late = RepairChannel(store, 0, 2), RepairChannel(store, 1, 2)
    assert early.settle("rank(s) 1 wrote no report") == "rank(s) 1 wrote no report"
    assert late.settle(None) == "rank(s) 1 wrote no report"  # it would have retried; its peer has stopped
    late.generation = 1
    assert late.settle(None) is None


def test_the_watcher_stops_once_per_generation_and_publishes_an_overdue_step(store):
    seen, overdue = [], []
    training = RepairChannel(store, 1, 2)  # the training thread's: the generation's one count
    watcher = Watcher(RepairChannel(store, 1, 2),  # a HashStore is shared by threads as it is
                      generation=lambda: training.generation,
                      on_fault=lambda generation, fault: seen.append(fault),
                      overdue=lambda: overdue.pop() if overdue else None, poll_s=0.05)
    watcher.start()
    try:
        RepairChannel(store, 0, 2).publish(fault(0))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert seen == [fault(0)]  # once, however many looks
        training.generation = 1  # the repair finished: the watcher looks at the next generation's keys
        overdue.append(fault(1, "stuck"))
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen[1] == fault(1, "stuck")
        channel = RepairChannel(store, 0, 2)
        channel.generation = 1
        assert channel.standing() == fault(1, "stuck")  # the peers see the stuck step too
    finally:
        watcher.close()


def test_the_verdict_is_the_same_line_everywhere_and_names_the_faulted_rank_first():
    from npu_inject.patches.step_repair import verdict

    stood = fault(1, "uce")
    ok = {"step": 3, "problem": ""}
    assert verdict({0: ok, 1: ok}, [], stood, 60) is None
    both = {0: {"step": 3, "problem": "the fault (stopped) came after the step's optimizer update began"},
            1: {"step": 3, "problem": "the fault (uce) came after the step's optimizer update began"}}
    line = verdict(both, [], stood, 60)
    assert line.startswith("npu_inject step_repair: step 3: not repairable in the job: rank 1: the fault (uce)")
    assert "rank 1's uce in step 3 (uce on 1)" in line
    assert "rank(s) 1 wrote no report within 60 s" in verdict({0: ok}, [1], stood, 60)
    assert "ranks stopped in different steps (3, 4)" in verdict({0: ok, 1: {"step": 4, "problem": ""}}, [], stood, 60)


@pytest.mark.parametrize("text, kind", [
    ("UCE ERROR, [ERROR] ... PTA call acl api failed", "uce"),
    ("The Inner error is reported as above. ... HcclSend", "queue_ended"),
    ("FORCE STOP, [ERROR] ...", "stopped"),
    ("npuSynchronizeDevice: ... error code is 13 ... HcclAllGather ... link error", "collective"),
    ("CUDA out of memory", None),
])
def test_fault_kinds(text, kind):
    from npu_inject.patches.step_repair import fault_kind

    assert fault_kind(text) == kind


def test_a_pipeline_stages_wrapped_error_is_read_through_its_cause():
    from npu_inject.patches.step_repair import chain_text, fault_kind

    try:
        try:
            raise RuntimeError("UCE ERROR, the kernel's own words")
        except RuntimeError as inner:
            raise RuntimeError("[Stage 0] failed to run forward") from inner
    except RuntimeError as outer:
        assert fault_kind(str(outer)) is None
        assert fault_kind(chain_text(outer)) == "uce"
