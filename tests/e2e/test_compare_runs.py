"""npu-inject compare on real CPU-rehearsal runs: two identical runs agree, a changed learning rate diverges.

Three deterministic fp32 llama3 debug runs of 4 steps on 1 rank: A (with TensorBoard, its
torchrun output saved in its dump folder as a user would with ``| tee``), B identical to A,
C with a larger peak learning rate. Step 1's loss and grad norm are computed before the first
optimizer step, so C leaves A at step 2 at the earliest.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from testkit import REPO, clean_env, train_llama

STEPS = 4
LR_FLAG = "--optimizer.param-groups.0.optimizer-kwargs.lr"  # torchtitan 0.3.0; llama3_debugmodel has 8e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare_runs")
    env = clean_env(TORCHTITAN_NPU="cpu")
    paths = {}
    for name, extra in (("a", ["--metrics.enable_tensorboard"]), ("b", []), ("c", [LR_FLAG, "2e-3"])):
        dump = root / name
        losses, log = train_llama("llama3_debugmodel", str(dump), env, steps=STEPS, nproc=1, extra=extra)
        assert sorted(losses) == list(range(1, STEPS + 1)), log[-2000:]
        (dump / "train.log").write_text(log)
        paths[name] = dump
    return paths


def npu_inject_compare(*args: str):
    return subprocess.run([sys.executable, "-m", "npu_inject", "compare", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_identical_runs_agree(runs):
    same = npu_inject_compare(runs["a"] / "train.log", runs["b"] / "train.log", "--tolerance", "0")
    print(same.stdout)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "loss           4          0.00e+00 (1)   0.00e+00  -" in same.stdout

    # A's dump folder holds TensorBoard events (full float32) and its log; the events are read.
    # B's log rounds loss to 5 decimals and grad norm to 4: they agree well within 1e-4.
    mixed = npu_inject_compare(runs["a"], runs["b"] / "train.log", "--tolerance", "1e-4")
    print(mixed.stdout)
    assert mixed.returncode == 0, mixed.stdout + mixed.stderr
    assert mixed.stdout.startswith("A: tensorboard ") and "tfevents" in mixed.stdout.splitlines()[0]


def test_changed_learning_rate_diverges_at_step_two(runs, tmp_path):
    png = tmp_path / "a_vs_c.png"
    result = npu_inject_compare(runs["a"] / "train.log", runs["c"] / "train.log", "--plot", png)
    print(result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line[:6].strip().isdigit()}
    assert "*" not in rows["1"], "step 1 runs before the first optimizer step: same loss and grad norm"
    assert "DIVERGED: first step past tolerance 0.01: step 2 (" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # The same dump folder without the saved log: torchtitan's own files hold no loss.
    bare = tmp_path / "c_without_log"
    shutil.copytree(runs["c"], bare, ignore=shutil.ignore_patterns("train.log"))
    missing = npu_inject_compare(runs["a"], bare)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"npu-inject: error: {bare}: no training metrics in this folder" in missing.stderr
