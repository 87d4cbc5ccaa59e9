"""torchtitan's fault tolerance (torchft) on the CPU rehearsal, upstream's own debug config (which names NCCL).

A lighthouse and one replica group of 2 ranks (torchft 0.2.0 from PyPI, DiLoCo as upstream configures it).
Upstream alone: torchft's NCCL group fails at every quorum and nothing is committed while the log looks like
training. Through the runtime: the group runs on gloo and every commit point commits; a group that can never
commit (min_replica_size above the replicas there are) stops on every rank with one line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit import clean_env, parse_losses, torchrun

pytest.importorskip("torchft")

ARGS = ["--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable",
        "--profiler.no-enable_profiling", "--fault_tolerance.replica_id", "0", "--fault_tolerance.group_size", "1",
        "--fault_tolerance.sync_steps", "2"]


@pytest.fixture
def lighthouse():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    server = subprocess.Popen([str(binary), "--min_replicas", "1", "--join_timeout_ms", "1000",
                               "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    server.kill()
    server.wait()


def test_upstream_torchft_config_commits_on_the_rehearsal(lighthouse, tmp_path):
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHFT_LIGHTHOUSE=lighthouse)
    result = torchrun([*ARGS, "--training.steps", "6", "--dump_folder", str(tmp_path)], env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert sorted(parse_losses(result.stdout)) == list(range(1, 7))
    committed = result.stdout.count("should_commit=True enough_replicas=True")
    assert committed >= 2 * 3 and "should_commit=False" not in result.stdout, result.stdout[-4000:]
    report = json.loads((tmp_path / "npu_inject" / "report_rank0.json").read_text())["patches"]["torchft_commits"]
    assert report["state"] == "applied"
    assert any(note.startswith("--fault_tolerance.process_group nccl runs on torchft's gloo group") for note in report["notes"])


def test_a_replica_group_that_never_commits_stops_with_one_line(lighthouse, tmp_path):
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHFT_LIGHTHOUSE=lighthouse)
    result = torchrun([*ARGS, "--fault_tolerance.min_replica_size", "2", "--training.steps", "20",
                       "--dump_folder", str(tmp_path)], env, timeout=600)
    assert result.returncode != 0
    stops = [line for line in result.stdout.splitlines() if line.startswith("npu_inject torchft_commits: ")]
    assert len(stops) == 2 and stops[0] == stops[1], result.stdout[-4000:]
    assert stops[0].startswith("npu_inject torchft_commits: torchft committed none of its first 5 commit points")
    assert max(parse_losses(result.stdout)) < 20
