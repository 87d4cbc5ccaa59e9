"""A worker group that torchrun restarts (``--max-restarts``) on the CPU rehearsal: one that would begin again at
step 1 from the initial weights stops with one line; one that resumes from its checkpoint trains on (patch
restart_progress). Real torchrun (restarts need its agent), llama3's debug model, 2 ranks, rank 1 killed."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit import REPO, clean_env, parse_losses
from tools.training_runs import free_port

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--profiler.no-enable_profiling",
        "--metrics.log_freq", "1", "--training.steps", "5"]


def restarted_run(tmp_path, fault: str, *extra: str) -> subprocess.CompletedProcess:
    env = clean_env(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1", TORCHTITAN_NPU_FAULTS=fault)
    env["TORCHTITAN_NPU_PATCHES"] += ",+inject_faults"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "--max-restarts", "1", "-m", "torchtitan.train", *ARGS,
               "--dump_folder", str(tmp_path), *extra]
    return subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)


def test_a_restart_without_a_checkpoint_stops_instead_of_training_from_scratch(tmp_path):
    result = restarted_run(tmp_path, "kill@3:rank=1", "--checkpoint.no-enable")
    assert result.returncode != 0
    stops = [line for line in result.stdout.splitlines() if line.startswith("npu_inject restart_progress: ")]
    assert len(stops) == 2 and stops[0] == stops[1], result.stdout[-4000:]
    assert stops[0].startswith("npu_inject restart_progress: restart attempt 1 of this worker group began again "
                               "at step 1, from the initial weights, after an earlier attempt reached step 2")
    assert max(parse_losses(result.stdout)) == 2  # attempt 1 trained its step 1 and stopped


def test_a_restart_that_resumes_from_its_checkpoint_trains_on(tmp_path):
    result = restarted_run(tmp_path, "kill@4:rank=1", "--checkpoint.enable", "--checkpoint.interval", "2")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "npu_inject restart_progress: " not in result.stdout
    report = json.loads((tmp_path / "npu_inject" / "report_rank0.json").read_text())["patches"]["restart_progress"]
    assert report["notes"] == ["restart attempt 1 began at step 3 (an earlier attempt reached step 3)"], report
