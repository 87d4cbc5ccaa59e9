"""torchtitan's own integration cases through ``npu-inject suite`` on the CPU rehearsal.

CI runs one case per parallelism dimension, one checkpoint save-and-resume, one compile and one
model-suite case (``CI_CASES``; the dry-run modes are tests/e2e/test_dry_runs.py), 2 steps at a
shrunk shape. ``-m upstream_suite`` runs every enabled case of both suites on the rehearsal and
prints the matrix. Each case must be green or stop with one clear line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testkit import REPO, clean_env

UPSTREAM = os.path.join(os.path.dirname(REPO), "shared", "upstream", "torchtitan-0.3")
NPU_INJECT = os.path.join(os.path.dirname(sys.executable), "npu-inject")
# (suite, case): what each stands for in CI.
CI_CASES = {
    ("features", "pp_1f1b"): "pipeline parallel",
    ("features", "ddp"): "data parallel (replicate)",
    ("features", "2d_eager"): "FSDP x tensor parallel",
    ("features", "cp"): "context parallel",
    ("features", "full_checkpoint"): "checkpoint save, then resume",
    ("features", "1d_compile"): "torch.compile",
    ("models", "deepseek_v3_hsdp+ep"): "a model-suite case (MoE: HSDP x expert parallel)",
}

needs_upstream = pytest.mark.skipif(not os.path.isdir(UPSTREAM), reason=f"upstream's suite is not at {UPSTREAM}")


def _suite(tmp_path, suites: str, cases: str, timeout: int) -> dict:
    command = [NPU_INJECT, "suite", "--torchtitan-src", UPSTREAM, "--suite", suites, "--steps", "2",
               "--shrink", "256,2", "--case-timeout", "900", "--output", str(tmp_path / "matrix")]
    if cases:
        command += ["--cases", cases]
    done = subprocess.run(command, env=clean_env(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1"), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    print(done.stdout)
    matrix = json.load(open(tmp_path / "matrix" / "matrix.json"))
    return {"exit": done.returncode, "stderr": done.stderr, **matrix}


@needs_upstream
@pytest.mark.e2e
@pytest.mark.parametrize("suite", ["features", "models"])
def test_ci_cases_are_green_on_the_rehearsal(tmp_path, suite):
    cases = ",".join(name for case_suite, name in CI_CASES if case_suite == suite)
    result = _suite(tmp_path, suite, cases, timeout=3600)
    rows = {row["name"]: row for row in result["cases"]}
    assert set(rows) == set(cases.split(","))
    bad = {name: (row["status"], row["cause"]) for name, row in rows.items() if row["status"] != "green"}
    assert not bad, bad
    assert result["exit"] == 0, result["stderr"][-3000:]
    for row in rows.values():
        assert row["last_loss"] is not None and row["last_loss"] < row["first_loss"] + 1.0, row


@needs_upstream
@pytest.mark.upstream_suite
def test_every_enabled_case_is_green_or_stops_clearly_on_the_rehearsal(tmp_path):
    result = _suite(tmp_path, "features,models", "", timeout=6 * 3600)
    bad = {row["name"]: (row["status"], row["cause"], row["attributed_to"]) for row in result["cases"]
           if row["status"] not in ("green", "stopped")}
    assert not bad, bad
