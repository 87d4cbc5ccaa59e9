"""Upstream torchtitan's llama3 debug model trains through the runtime (CPU rehearsal, 2 ranks, FSDP).

Parity is checked the way torchtitan checks itself: deterministic, fixed seed,
fp32, per-step losses compared with a run whose attention is independent plain
PyTorch (tests/support/plugins/sdpa_reference_attention.py), and 1-rank vs 2-rank runs
from the same seed checkpoint.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from testkit import LLAMA_STEPS, REPO, clean_env, from_seed, train_llama

pytestmark = pytest.mark.e2e

CONFIGS = ("llama3_debugmodel", "llama3_debugmodel_varlen_attn")


@pytest.mark.parametrize("config", CONFIGS)
def test_trains_ten_steps_with_falling_loss(llama_runs, config):
    losses, log, dump = llama_runs(config, "cpu")
    assert sorted(losses) == list(range(1, LLAMA_STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses.values())
    assert losses[LLAMA_STEPS] < losses[1] - 1.5, losses  # clearly falling
    summary = [line for line in log.splitlines() if "npu_inject: target=cpu" in line]
    assert len(summary) == 1, "rank 0 alone logs one summary line"
    for rank in (0, 1):
        report = json.load(open(os.path.join(dump, "npu_inject", f"report_rank{rank}.json")))
        states = {patch_id: record["state"] for patch_id, record in report["patches"].items()}
        assert states["device"] == states["attention"] == "applied", states
        assert report["patches"]["attention"]["fallbacks"] == []


@pytest.mark.parametrize("config", CONFIGS)
def test_loss_parity_with_independent_attention(llama_runs, config):
    patched, _, _ = llama_runs(config, "cpu")
    reference, log, _ = llama_runs(config, "reference")
    assert "sdpa_reference_attention" in log and sorted(reference) == sorted(patched)
    worst = max(abs(patched[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"{config}: max relative loss difference over {LLAMA_STEPS} steps: {worst:.2e}")
    assert worst <= 1e-4, (patched, reference)


def test_one_and_two_ranks_agree_from_a_seed_checkpoint(tmp_path, seed_checkpoint):
    # Data duplicated so that each of 2 ranks reads the same documents as 1 rank does.
    data = open(os.path.join(REPO, "tests", "assets", "c4_test", "data.json")).read()
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "data.json").write_text(data + data)
    env = clean_env(TORCHTITAN_NPU="cpu")
    load = ["--dataloader.dataset_path", str(tmp_path / "dup"), *from_seed(seed_checkpoint)]
    one, _ = train_llama("llama3_debugmodel", str(tmp_path / "one"), env, steps=2, nproc=1, extra=load)
    two, _ = train_llama("llama3_debugmodel", str(tmp_path / "two"), env, steps=2, nproc=2, extra=load)
    print(f"1 rank: {one}, 2 ranks: {two}")
    assert abs(one[1] - two[1]) / abs(one[1]) <= 1e-5
