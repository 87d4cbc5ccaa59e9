"""docs/suite.md's capability matrix and the README's counts are what tools/suite_table.py renders from
the recorded suite runs, and those runs cover every enabled case of upstream's integration suite on
every target."""

from __future__ import annotations

import pytest

from testkit import TORCHTITAN_SRC, needs_torchtitan_src  # first: puts the repository root on sys.path
from tools import doc_blocks, suite_table

needs_case_lists = needs_torchtitan_src("tests/integration_tests")


def test_docs_hold_the_rendered_matrix_and_the_readme_its_counts():
    with open(suite_table.DOC, encoding="utf-8") as handle:
        assert doc_blocks.block(handle.read(), suite_table.BEGIN, suite_table.END) == suite_table.render(), (
            "docs/suite.md's suite matrix is stale: python tools/suite_table.py --write")
    with open(suite_table.README, encoding="utf-8") as handle:
        counts = doc_blocks.block(handle.read(), suite_table.COUNTS_BEGIN, suite_table.COUNTS_END)
    assert counts == suite_table.render_counts(), "README.md's suite counts are stale: tools/suite_table.py --write"
    assert len(counts.splitlines()) == 2 + len(suite_table.TARGETS)


@needs_case_lists
@pytest.mark.parametrize("target", list(suite_table.TARGETS))
def test_each_target_ran_every_enabled_case_of_both_suites(target):
    from npu_inject.commands import suite

    expected = {f"{case.suite}/{case.name}" for case in suite.load_cases(TORCHTITAN_SRC, ["features", "models"])}
    matrix = suite_table.load(target)
    assert {f"{case['suite']}/{case['name']}" for case in matrix["cases"]} == expected
    assert matrix["meta"]["target"] == ("cpu" if target == "rehearsal" else "npu")
    assert matrix["meta"]["simulated_npu"] is (target == "sim_npu")


def test_docs_hold_the_advanced_suites_block():
    with open(suite_table.DOC, encoding="utf-8") as handle:
        assert doc_blocks.block(handle.read(), suite_table.H100_BEGIN, suite_table.H100_END) == \
            suite_table.render_h100(), "docs/suite.md's h100 block is stale: python tools/suite_table.py --write"


def test_docs_hold_the_full_shape_block_and_every_case_ran_within_the_hosts_memory():
    with open(suite_table.DOC, encoding="utf-8") as handle:
        assert doc_blocks.block(handle.read(), suite_table.FULL_BEGIN, suite_table.FULL_END) == \
            suite_table.render_full(), "docs/suite.md's full-shape block is stale: python tools/suite_table.py --write"
    (target,) = suite_table.FULL_TARGETS
    matrix = suite_table.load(target)
    assert not matrix["meta"].get("shrink")
    for case in matrix["cases"]:
        # Planned before it started, and a case the plan let start was not killed for memory.
        assert case["status"] != "memory" or case["runs"] == 0, case


def test_the_host_margin_covers_every_shortfall_the_full_shape_pass_measured():
    from npu_inject.planner.host_memory import HOST_MARGIN

    (target,) = suite_table.FULL_TARGETS
    cases = suite_table.load(target)["cases"]
    measured = [case for case in cases if suite_table.plan_error(case) is not None]
    assert measured
    for case in measured:
        assert case["peak_rss_gib"] <= case["planned_gib"] * HOST_MARGIN, case["name"]
    summary = suite_table.plan_error_summary(cases)
    assert f"on the {len(measured)} cases" in summary and f"x{HOST_MARGIN:g}" in summary


def test_parts_add_and_replace_cases(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(suite_table, "DATA", str(tmp_path / "data"))
    meta = {"target": "rehearsal", "date": "2026-11-26 00:00 UTC", "machine": "m", "steps": 2, "command": "c"}
    def case(name, status):
        return {"suite": "features", "name": name, "ngpu": 4, "status": status, "seconds": 1.0, "cause": "",
                "attributed_to": "", "runs": 1, "peak_rss_gib": 3.0, "planned_gib": 2.5, "command": "c"}
    for part, cases in (("one", [case("a", "green"), case("b", "red")]), ("two", [case("b", "green"), case("c", "green")])):
        (tmp_path / part).mkdir()
        (tmp_path / part / "matrix.json").write_text(json.dumps({"meta": meta, "cases": cases}))
    suite_table.record_parts("full/rehearsal", [str(tmp_path / "one"), str(tmp_path / "two")])
    merged = json.loads((tmp_path / "data" / "full" / "rehearsal.json").read_text())
    assert [(c["name"], c["status"]) for c in merged["cases"]] == [("a", "green"), ("b", "green"), ("c", "green")]
    assert merged["meta"]["reruns"][0]["cases"] == ["features/b", "features/c"]


@needs_case_lists
@pytest.mark.parametrize("target", list(suite_table.H100_TARGETS))
def test_each_target_ran_every_enabled_case_of_the_advanced_suite(target):
    from npu_inject.commands import suite

    expected = {f"h100/{case.name}" for case in suite.load_cases(TORCHTITAN_SRC, ["h100"])}
    matrix = suite_table.load(target)
    assert {f"{case['suite']}/{case['name']}" for case in matrix["cases"]} == expected
    assert matrix["meta"]["target"] == ("cpu" if target == "h100/rehearsal" else "npu")
    assert matrix["meta"]["simulated_npu"] is (target == "h100/sim_npu")
    assert {case["name"]: case["status"] for case in matrix["cases"]}["dist_gemm"] == "green"


def test_every_row_that_is_not_green_says_why():
    for target in [*suite_table.TARGETS, *suite_table.H100_TARGETS]:
        for case in suite_table.load(target)["cases"]:
            if case["status"] != "green":
                assert case["cause"] and case["attributed_to"], (target, case["name"])


def test_a_rerun_replaces_its_rows_and_is_listed(tmp_path, monkeypatch):
    import json

    meta = {"target": "cpu", "date": "d1", "machine": "m", "command": "c1", "steps": 2, "shrink": [256, 2],
            "npu_inject_commit": "aaa"}
    row = lambda name, status: {"suite": "features", "name": name, "ngpu": 2, "status": status,  # noqa: E731
                                "seconds": 1.0, "cause": "" if status == "green" else "boom", "attributed_to": "",
                                "command": f"bash /home/me/tt/run_train.sh --dump_folder "
                                           f"/scratch/o/artifacts-to-be-uploaded/{name}"}
    monkeypatch.setattr(suite_table, "DATA", str(tmp_path))
    (tmp_path / "rehearsal.json").write_text(json.dumps({"meta": meta, "cases": [row("a", "green"), row("b", "red")]}))
    (tmp_path / "run").mkdir()
    later = {"meta": {**meta, "date": "d2", "command": "npu-inject suite --output /scratch/o --cases b",
                      "npu_inject_commit": "bbb"}, "cases": [row("b", "green")]}
    (tmp_path / "run" / "matrix.json").write_text(json.dumps(later))
    suite_table.rerun("rehearsal", str(tmp_path / "run"))
    merged = suite_table.load("rehearsal")
    assert [case["status"] for case in merged["cases"]] == ["green", "green"]
    assert merged["meta"]["reruns"] == [{"cases": ["features/b"], "date": "d2", "npu_inject_commit": "bbb",
                                         "machine": "m", "command": "npu-inject suite --output $OUTPUT --cases b"}]
    # Recorded data names no folder of the machine it ran on.
    assert merged["cases"][1]["command"] == ("bash $TORCHTITAN_SRC/run_train.sh --dump_folder "
                                             "$OUTPUT/artifacts-to-be-uploaded/b")
    (tmp_path / "run" / "matrix.json").write_text(json.dumps({**later, "meta": {**later["meta"], "steps": 10}}))
    with pytest.raises(SystemExit, match="other steps"):
        suite_table.rerun("rehearsal", str(tmp_path / "run"))
