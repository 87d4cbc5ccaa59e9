"""torchtitan training runs for the tools and the tests: a clean environment, the launch, the losses.

``torchrun`` launches ``torchrun -m torchtitan.train`` from the repository root, forking the ranks
from a warm process (tools/forklaunch.py) where it can; tools/parallel_matrix.py and the test suite
(tests/support/testkit.py) launch their runs through it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/ -> repo
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from npu_inject.commands.suite import LOSS_LINE  # noqa: E402  (torchtitan's metric line, as the suite reads it)
from tools import forklaunch  # noqa: E402


def clean_env(**overrides: str) -> dict[str, str]:
    """The current environment without TORCHTITAN_NPU*, plus overrides (the rehearsal's host check off unless
    named: :func:`without_host_memory_check`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}
    env.update(overrides)
    return without_host_memory_check(env)


def without_host_memory_check(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the rehearsal's start-up host check off unless the selection names it: the check plans each
    run first (15-30 s of a test's time; tests/unit/patches/test_host_memory_check.py and its e2e case cover it),
    and the tests' jobs are small enough for any host."""
    selection = env.get("TORCHTITAN_NPU_PATCHES", "")
    if env.get("TORCHTITAN_NPU") != "cpu" or "host_memory_check" in selection:
        return env
    return {**env, "TORCHTITAN_NPU_PATCHES": f"{selection},-host_memory_check" if selection else "-host_memory_check"}


def parse_losses(log: str) -> dict[int, float]:
    """step -> loss from torchtitan's metric lines (every rank logs the same global loss)."""
    return {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(log)}


def torchrun(args: list[str], env: dict[str, str], nproc: int = 2, timeout: int = 600, real: bool = False,
             python: str | None = None):
    """Run ``torchrun -m torchtitan.train`` from the repo root (where the debug configs find
    tests/assets). Returns the CompletedProcess; stdout holds both streams.

    The ranks are forked from a warm process (tools/forklaunch.py: the same bootstrap and
    imports, without paying torch's import per rank) unless ``real`` is set, ``python`` names
    another interpreter (e.g. the CANN emulation's venv), the run changes a variable read at
    import time, or NPU_INJECT_TEST_LAUNCHER=torchrun."""
    env = {"HF_HUB_OFFLINE": "1", **env}
    env = without_host_memory_check(env)
    port = free_port()
    if python is None and not real and os.environ.get(forklaunch.LAUNCHER_VAR, "fork") != "torchrun":
        if _LAUNCHER.process is None:
            _LAUNCHER.start(clean_env(HF_HUB_OFFLINE="1"))
        differences = forklaunch.import_time_differences(env, _LAUNCHER.server_env)
        if not differences:
            return _LAUNCHER.run(list(args), env, REPO, nproc, port, timeout)
        print(f"training_runs.torchrun: real torchrun, the run sets {differences} differently from the warm "
              "launcher", file=sys.stderr)
    command = [python or sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(port), "-m", "torchtitan.train", *args]
    return subprocess.run(command, env=env, cwd=REPO, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


_LAUNCHER = forklaunch.Launcher()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
