"""torchtitan's own integration cases through ``npu-inject suite`` on the CPU rehearsal, simulated NPUs and the
real torch_npu wheel on the CANN emulation.

CI runs one case of each upstream suite through the suite runner: a features case and a model-suite case on
the rehearsal (``CI_CASES``) and an advanced case on the emulation (``CANN_CI_CASES``, through upstream's
run_train.sh, expandable segments on), 2 steps at a shrunk shape. Each parallelism dimension itself is CI's in
tests/e2e/test_parallel_matrix.py (against one rank, on all three targets); the dry-run modes are
tests/e2e/test_dry_runs.py, a checkpoint's save and resume tests/e2e/test_checkpoint_resume.py, torch.compile
tests/e2e/test_compile_train.py. ``-m upstream_suite`` runs every enabled case of both suites on the rehearsal
and simulated NPUs (``SIM_CI_CASES`` among them), and upstream's advanced suite (``h100``) on all three targets,
and prints the matrix. Each case must be green or stop with one clear line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testkit import REPO, TORCHTITAN_SRC, clean_env, needs_torchtitan_src, sim_npu_env  # first: repo on sys.path
from tools.parallel_matrix import CANN_PYTHON, cann_missing
from verification.cann_emu import cann_env

NPU_INJECT = os.path.join(os.path.dirname(sys.executable), "npu-inject")
# (suite, case): what each stands for in CI.
# The features suite's pp_1f1b, ddp and cp cases ran here too until 2026-11-28 (292 s of CI's 60 min with 2d_eager):
# the parallel matrix covers those dimensions in CI, -m upstream_suite every case.
CI_CASES = {
    ("features", "2d_eager"): "a features-suite case (FSDP x tensor parallel, 4 ranks)",
    ("models", "deepseek_v3_hsdp+ep"): "a model-suite case (MoE: HSDP x expert parallel)",
}

# On simulated NPUs ("hccl" over the simulated devices): a 4-rank case crossing FSDP, TP and sequence parallel,
# with -m upstream_suite (193 s under CI's load; CI's sim_fsdp_x_tp in the parallel matrix is the same layout).
SIM_CI_CASES = {("features", "2d_eager"): "FSDP x tensor parallel on simulated NPUs"}
# On the real torch_npu wheel (CANN emulation): MC2 tensor parallelism (dist_gemm, FSDP 2 x TP 2) through
# upstream's run_train.sh, whose expandable segments take torch_npu's virtual-memory allocator.
CANN_CI_CASES = {("h100", "dist_gemm"): "TP on MC2 kernels through the real torch_npu wheel"}
TARGET_ENVS = {
    "cpu": lambda: clean_env(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1"),
    "npu": lambda: {**sim_npu_env(HF_HUB_OFFLINE="1"), "TORCHTITAN_NPU_SIM_DEVICES": "8"},
    "cann": lambda: cann_env(clean_env(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")),
}
# The suite runs under the target's interpreter (run_train.sh finds torchrun beside it).
SUITE_COMMANDS = {"cpu": [NPU_INJECT, "suite"], "npu": [NPU_INJECT, "suite"],
                  "cann": [CANN_PYTHON, "-m", "npu_inject", "suite"]}
needs_cann = pytest.mark.skipif(cann_missing() is not None, reason=cann_missing() or "")

needs_upstream = needs_torchtitan_src("tests/integration_tests, run_train.sh")


def _suite(tmp_path, suites: str, cases: str, timeout: int, target: str = "cpu") -> dict:
    command = [*SUITE_COMMANDS[target], "--torchtitan-src", TORCHTITAN_SRC, "--suite", suites, "--steps", "2",
               "--shrink", "256,2", "--case-timeout", "900", "--output", str(tmp_path / "matrix")]
    if cases:
        command += ["--cases", cases]
    done = subprocess.run(command, env=TARGET_ENVS[target](), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    print(done.stdout)
    matrix = json.load(open(tmp_path / "matrix" / "matrix.json"))
    return {"exit": done.returncode, "stderr": done.stderr, **matrix}


@needs_upstream
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
def test_ci_cases_are_green_on_simulated_npus(tmp_path):
    cases = ",".join(name for _, name in SIM_CI_CASES)
    result = _suite(tmp_path, "features", cases, timeout=3600, target="npu")
    assert result["meta"]["target"] == "npu" and result["meta"]["simulated_npu"] is True
    bad = {row["name"]: (row["status"], row["cause"]) for row in result["cases"] if row["status"] != "green"}
    assert not bad and len(result["cases"]) == len(SIM_CI_CASES), (bad, result["stderr"][-3000:])


@needs_upstream
@pytest.mark.upstream_suite
@pytest.mark.parametrize("target", ["cpu", "npu"])
def test_every_enabled_case_is_green_or_stops_clearly(tmp_path, target):
    result = _suite(tmp_path, "features,models", "", timeout=6 * 3600, target=target)
    bad = {row["name"]: (row["status"], row["cause"], row["attributed_to"]) for row in result["cases"]
           if row["status"] not in ("green", "stopped")}
    assert not bad, bad


@needs_upstream
@needs_cann
@pytest.mark.cann_emu
def test_ci_cases_are_green_on_the_cann_emulation(tmp_path):
    """The MC2 path through the real wheel, launched as upstream launches (run_train.sh, expandable segments)."""
    cases = ",".join(name for _, name in CANN_CI_CASES)
    result = _suite(tmp_path, "h100", cases, timeout=3600, target="cann")
    assert result["meta"]["target"] == "npu" and not result["meta"]["simulated_npu"]
    bad = {row["name"]: (row["status"], row["cause"]) for row in result["cases"] if row["status"] != "green"}
    assert not bad and len(result["cases"]) == len(CANN_CI_CASES), (bad, result["stderr"][-3000:])


@needs_upstream
@pytest.mark.upstream_suite
@pytest.mark.parametrize("target", ["cpu", "npu", pytest.param("cann", marks=needs_cann)])
def test_every_advanced_case_is_green_or_stops_clearly(tmp_path, target):
    """Upstream's h100 suite: dist_gemm and async TP green, float8, symmetric-memory FSDP and the DeepEP-family
    MoE backends one clear line each."""
    result = _suite(tmp_path, "h100", "", timeout=3 * 3600, target=target)
    statuses = {row["name"]: row["status"] for row in result["cases"]}
    assert statuses["dist_gemm"] == statuses["2d_asynctp_compile"] == "green", result["cases"]
    bad = {row["name"]: (row["status"], row["cause"]) for row in result["cases"] if row["status"] not in ("green", "stopped")}
    assert not bad, bad
