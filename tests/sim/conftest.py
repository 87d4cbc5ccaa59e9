"""Shared helpers for the simulated-NPU tests.

The simulator changes process-wide PyTorch state (PrivateUse1 becomes "npu",
torch.accelerator reports it), so nothing here imports it into the pytest
process: unit suites (tests/sim/unit) and rank programs (tests/sim/workers)
run in child processes under ``sim_env``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.training_runs import clean_env  # noqa: E402
from verification.sim_npu import sim_env  # noqa: E402

WORKERS_DIR = Path(__file__).resolve().parent / "workers"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def sim_child_env() -> dict[str, str]:
    """Environment for a child process that imports the simulated torch_npu, without TORCHTITAN_NPU*: a
    selection left in this process's environment would start the runtime's bootstrap in the child, which would
    patch its imports before its tests did."""
    return sim_env(clean_env())


@pytest.fixture
def run_ranks():
    """run_ranks(worker_name, *args, world_size=2, timeout=240, env=None) runs
    tests/sim/workers/<name>.py once per rank (env: extra variables) and returns their outputs."""

    def run(
        worker: str,
        *args: str,
        world_size: int = 2,
        timeout: float = 240,
        env: dict[str, str] | None = None,
    ) -> list[str]:
        script = WORKERS_DIR / f"{worker}.py"
        port = str(_free_port())
        processes = []
        for rank in range(world_size):
            rank_env = sim_env(os.environ, devices=max(world_size, 2))
            rank_env.update(
                env or {},
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=rank_env,
                    cwd=REPO_ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = []
        failures = []
        for rank, process in enumerate(processes):
            try:
                output, _ = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other in processes:
                    other.kill()
                output, _ = process.communicate()
                failures.append(f"rank {rank} timed out after {timeout} s:\n{_tail(output)}")
                continue
            outputs.append(output)
            if process.returncode != 0:
                failures.append(f"rank {rank} exited with {process.returncode}:\n{_tail(output)}")
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)
        return outputs

    return run
