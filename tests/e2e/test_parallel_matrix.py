"""The parallelism matrix (tools/parallel_matrix.py) against 1-rank runs from one seed checkpoint.

``bash tools/test.sh -m parallel`` runs every case and prints the table; CI (``-m e2e``)
runs the cases marked ``ci`` in tools/parallel_matrix.py: one per dimension in the rehearsal
(replicate/DDP, TP with sequence parallel, PP 1F1B, CP flex and varlen with both schemes between
them; EP runs in tests/e2e/test_moe_train.py), every simulated-NPU case (FSDP x TP, PP 1F1B,
CP flex and varlen) and, of the same four through the real torch_npu on the CANN emulation (marked
cann_emu too; skipped when its venv is not set up), PP 1F1B.
Each case must keep every step's loss within 1e-4 relative of the 1-rank run.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import parallel_matrix  # noqa: E402

RTOL = 1e-4


_ROWS: list[dict] = []
_RUNNER: dict = {}


@pytest.fixture(scope="module")
def table_at_end(request):
    yield _ROWS
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if _ROWS and reporter is not None:
        reporter.write_line("\n" + parallel_matrix.table(_ROWS, RTOL))


@pytest.fixture
def matrix(request, tmp_path_factory, table_at_end):
    if "runner" not in _RUNNER:
        # The session's llama3 seed checkpoint (tests/conftest.py) is the one the matrix would write.
        _RUNNER["runner"] = parallel_matrix.Matrix(str(tmp_path_factory.mktemp("parallel_matrix")), steps=4,
                                                   seeds={"llama3": request.getfixturevalue("seed_checkpoint")})
    return _RUNNER["runner"], table_at_end


def _marks(case):
    marks = [pytest.mark.parallel]
    if case.ci:
        marks.append(pytest.mark.e2e)
    if case.target == "cann":
        marks.append(pytest.mark.cann_emu)
        missing = parallel_matrix.cann_missing()
        if missing:
            marks.append(pytest.mark.skip(reason=missing))
    return marks


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_marks(c)) for c in parallel_matrix.CASES])
def test_configuration_matches_one_rank(case, matrix):
    runner, rows = matrix
    row = runner.run(case)
    rows.append(row)
    assert not row["missing_steps"], row
    assert row["max_rel_diff"] <= RTOL, (row["losses"], row["expected"])
    if case.options.get("context_parallel"):
        scheme = case.options["context_parallel"]["scheme"]
        assert any(f"scheme '{scheme}' ran" in note for note in row["notes"]), row["notes"]
