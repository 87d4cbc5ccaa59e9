"""The search's rules on plans it is handed (nothing recorded here: tests/e2e/test_plan.py runs a search): which
layouts it plans again at full depth, what its table says of its figures, and that a long wait is never silent."""

from __future__ import annotations

import concurrent.futures
import threading
import types

import pytest

from npu_inject.planner import render, search, workers

GIB = 2**30
FACTS = {"layers": 32, "heads": 32, "kv_heads": 8, "experts": None, "seq_len": 8192, "global_batch_size": 2,
         "microbatch_size": 1, "model": "llama3 8B"}
ALONE, TP2 = search.Layout(1, 2, 1, 1, 1, 1), search.Layout(1, 1, 1, 2, 1, 1)


def _plan(gib: float, step_s: float):
    return types.SimpleNamespace(fits=gib <= 64, worst=types.SimpleNamespace(total=gib * GIB), capacity=64 * GIB,
                                 step_s=step_s, tokens_per_s_per_npu=1000 / step_s, mfu=0.3,
                                 extrapolated={"units_recorded": [3, 4]})


class _Started:
    """A shallow plan as the search starts it: still recording for its first ``unfinished`` waits that block."""

    def __init__(self, plan, unfinished: int = 0) -> None:
        self.plan, self.unfinished = plan, unfinished

    def wait(self, timeout):
        if self.unfinished and timeout:
            self.unfinished -= 1
            return False
        return not self.unfinished

    def result(self):
        return self.plan


def _search(monkeypatch, shallow: dict, full: dict, unfinished: dict | None = None):
    """Search the two layouts: ``shallow[(layout, local batch, ac)]`` is each shallow plan (others far too large),
    ``full[layout]`` the full-depth one, ``unfinished[key]`` how many waits the plan is still recording for.
    Returns the result, the layouts planned at full depth, the progress lines."""
    monkeypatch.setattr(search, "layouts", lambda facts, world, scale_up: [ALONE, TP2])
    planned_full, lines = [], []

    def start(argv, candidate):
        key = (candidate.layout, candidate.local_batch, candidate.ac)
        return _Started(shallow.get(key, _plan(300.0, 0.5)), (unfinished or {}).get(key, 0))

    def at_full_depth(argv, candidate):
        planned_full.append(candidate.layout)
        return full[candidate.layout]

    result = search.search(["--module", "llama3"], FACTS, 2, 8, start, progress=lines.append, full=at_full_depth)
    return result, planned_full, lines


@pytest.mark.parametrize("tp2_gib, planned_full", [
    (66.0, [TP2]),  # just over the device, and faster: a full-depth plan decides (here it fits)
    (80.0, [ALONE]),  # well over: its shallow verdict stands, the fitting layout is confirmed
])
def test_a_faster_layout_just_over_the_device_is_planned_at_full_depth_before_it_is_passed_over(
        monkeypatch, tp2_gib, planned_full):
    """deepseek_v3_671b on 1024 A3 dies: the search said 65.9 GiB, does not fit, for a layout a single plan (full
    depth) fits in 54.7. A layout that near the limit gets the single plan's verdict when it would be the fastest."""
    shallow = {(ALONE, 1, "full"): _plan(40.0, 2.0), (TP2, 1, "full"): _plan(tp2_gib, 1.0)}
    full = {ALONE: _plan(41.0, 2.0), TP2: _plan(55.0, 1.0)}
    result, planned, _ = _search(monkeypatch, shallow, full)
    assert planned == planned_full
    assert result.best is full[planned_full[0]] and result.best_shallow is shallow[(planned_full[0], 1, "full")]
    assert render.best_candidate(result).layout == planned_full[0]


def test_near_the_limit_is_within_the_shallow_plans_error_of_the_device_either_side():
    capacity = 64
    limit = search.SHALLOW_MEMORY_ERROR * capacity
    for gib, near in ((capacity - limit - 0.1, False), (capacity - limit + 0.1, True), (capacity + limit - 0.1, True),
                      (capacity + limit + 0.1, False)):
        assert search.near_the_limit(_plan(gib, 1.0)) is near, gib


def test_the_table_says_its_figures_are_shallow_and_marks_those_near_the_limit(monkeypatch):
    shallow = {(ALONE, 1, "full"): _plan(40.0, 2.0), (TP2, 1, "full"): _plan(60.0, 1.0)}
    full = {ALONE: _plan(41.0, 2.0), TP2: _plan(59.0, 1.0)}
    result, _, _ = _search(monkeypatch, shallow, full)
    profile = types.SimpleNamespace(name="Ascend910B2")
    lines = render.search_lines(result, FACTS, 2, profile)
    assert lines[2:4] == ["       1,000  30.0%    1.000   60.0* tp 2, local batch 1 x 2 accumulated, AC full",
                          "         500  30.0%    2.000   40.0  dp_shard 2, local batch 1, AC full"], lines
    assert lines[4] == ("  (each layout planned shallow: 3 and 4 repeats of the layer block per stage, extrapolated; "
                        "* within 10% of the device's 64.0 GiB, where a full-depth plan, its flags without --search, "
                        "may give the other verdict)"), lines


def test_while_the_layouts_record_the_search_says_how_many_are_done(monkeypatch):
    shallow = {(ALONE, 1, "full"): _plan(40.0, 2.0), (TP2, 1, "full"): _plan(50.0, 1.0)}
    _, _, lines = _search(monkeypatch, shallow, {ALONE: _plan(41.0, 2.0), TP2: _plan(51.0, 1.0)},
                          unfinished={(ALONE, 1, "full"): 2})
    waits = [line for line in lines if "layouts of this pass recorded" in line]
    # the first layout still records through two heartbeats (done by the second's count), the second is done
    assert waits == [f"{done} of 2 layouts of this pass recorded; next: dp_shard 2, local batch 1, AC full"
                     for done in (1, 2)], lines


def test_a_wait_with_nothing_finished_says_what_it_waits_for(monkeypatch):
    monkeypatch.setattr(workers, "HEARTBEAT_S", 0.01)
    future: concurrent.futures.Future = concurrent.futures.Future()
    timer = threading.Timer(0.2, future.set_result, (1,))
    timer.start()
    lines: list[str] = []
    finished = list(workers.wait_for([future], lines.append, lambda done, seconds: f"{done} of 1 done"))
    timer.join()
    assert finished == [future]
    assert lines and set(lines) == {"0 of 1 done"}, lines


def test_the_planners_own_work_says_it_is_still_at_it(monkeypatch):
    """A pipeline's shallow recordings took 19 s to evaluate in the search's process (deepseek_v3_671b PP 2)."""
    monkeypatch.setattr(workers, "HEARTBEAT_S", 0.01)
    lines: list[str] = []
    with workers.saying(lines.append, lambda seconds: "replaying"):
        threading.Event().wait(0.2)
    said = len(lines)
    threading.Event().wait(0.05)
    assert said and set(lines) == {"replaying"} and len(lines) == said, lines  # and nothing once it is done



def test_a_heartbeat_is_due_when_nothing_was_said_for_ten_seconds_whoever_said_the_last_line(capsys):
    """A wait's heartbeat at 10 s, then 10 s of the planner's own work, left 21 s between two lines (the
    deepseek_v3_671b search on a busy host): the beats count from the last line said."""
    progress = workers.Progress(started=0.0)
    progress("recorded 3 of 8")
    assert "] recorded 3 of 8" in capsys.readouterr().err  # on stderr: stdout holds the plan alone
    progress.last -= 8.0
    assert abs(workers.next_beat(progress) - (workers.HEARTBEAT_S - 8.0)) < 0.5
    progress.last -= 5.0
    assert workers.next_beat(progress) == 0.0
    assert workers.next_beat(print) == workers.HEARTBEAT_S  # any other callable: every HEARTBEAT_S of the wait
