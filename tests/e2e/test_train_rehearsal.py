"""Upstream torchtitan's llama3 debug model trains through the runtime (CPU rehearsal, 2 ranks, FSDP).

Parity is checked the way torchtitan checks itself: deterministic, fixed seed,
fp32, per-step losses compared with a run whose attention is independent plain
PyTorch (tests/plugins/sdpa_reference_attention.py), and 1-rank vs 2-rank runs
from the same seed checkpoint.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from conftest import REPO, clean_env, parse_losses, reference_attention_env, torchrun

pytestmark = pytest.mark.e2e

STEPS = 10
DETERMINISTIC = ["--debug.seed", "42", "--debug.deterministic", "--training.mixed_precision_param", "float32"]
SHORT = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--validator.no-enable"]
CONFIGS = ("llama3_debugmodel", "llama3_debugmodel_varlen_attn")


def train(config: str, dump: str, env: dict, steps: int = STEPS, extra=(), nproc: int = 2):
    args = ["--module", "llama3", "--config", config, "--training.steps", str(steps), *SHORT, *DETERMINISTIC,
            "--dump_folder", dump, *extra]
    if "--checkpoint.enable" not in extra:
        args.append("--checkpoint.no-enable")
    result = torchrun(args, env, nproc=nproc)
    assert result.returncode == 0, result.stdout[-4000:]
    return parse_losses(result.stdout), result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each (config, attention) pair trains once; the tests below read the results."""
    cache = {}

    def get(config: str, attention: str):
        if (config, attention) not in cache:
            dump = str(tmp_path_factory.mktemp(f"{config}_{attention}"))
            env = clean_env(TORCHTITAN_NPU="cpu") if attention == "patched" else reference_attention_env()
            losses, log = train(config, dump, env)
            cache[config, attention] = losses, log, dump
        return cache[config, attention]

    return get


@pytest.mark.parametrize("config", CONFIGS)
def test_trains_ten_steps_with_falling_loss(runs, config):
    losses, log, dump = runs(config, "patched")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses.values())
    assert losses[STEPS] < losses[1] - 1.5, losses  # clearly falling
    summary = [line for line in log.splitlines() if "npu_inject: target=cpu" in line]
    assert len(summary) == 1, "rank 0 alone logs one summary line"
    for rank in (0, 1):
        report = json.load(open(os.path.join(dump, "npu_inject", f"report_rank{rank}.json")))
        states = {patch_id: record["state"] for patch_id, record in report["patches"].items()}
        assert states["device"] == states["attention"] == "applied", states
        assert report["patches"]["attention"]["fallbacks"] == []


@pytest.mark.parametrize("config", CONFIGS)
def test_loss_parity_with_independent_attention(runs, config):
    patched, _, _ = runs(config, "patched")
    reference, log, _ = runs(config, "reference")
    assert "sdpa_reference_attention" in log and sorted(reference) == sorted(patched)
    worst = max(abs(patched[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"{config}: max relative loss difference over {STEPS} steps: {worst:.2e}")
    assert worst <= 1e-4, (patched, reference)


def test_one_and_two_ranks_agree_from_a_seed_checkpoint(tmp_path):
    # Data duplicated so that each of 2 ranks reads the same documents as 1 rank does.
    data = open(os.path.join(REPO, "tests", "assets", "c4_test", "data.json")).read()
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "data.json").write_text(data + data)
    env = clean_env(TORCHTITAN_NPU="cpu")
    data_flag = ["--dataloader.dataset_path", str(tmp_path / "dup")]
    seed_dump = str(tmp_path / "seed")
    train("llama3_debugmodel", seed_dump, env, steps=1, nproc=1, extra=[
        *data_flag, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
        "--parallelism.data_parallel_shard_degree", "1"])
    load = [*data_flag, "--checkpoint.enable", "--checkpoint.interval", "1000",
            "--checkpoint.initial_load_path", os.path.join(seed_dump, "checkpoint", "step-0")]
    one, _ = train("llama3_debugmodel", str(tmp_path / "one"), env, steps=2, nproc=1, extra=load)
    two, _ = train("llama3_debugmodel", str(tmp_path / "two"), env, steps=2, nproc=2, extra=load)
    print(f"1 rank: {one}, 2 ranks: {two}")
    assert abs(one[1] - two[1]) / abs(one[1]) <= 1e-5
