"""Simulated Ascend NPU for tests (see README.md in this directory).

``sim_env`` gives the environment under which ``import torch_npu`` loads the
simulator's stand-in package::

    from verification.sim_npu import sim_env
    subprocess.run(cmd, env=sim_env(os.environ), check=True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SIM_ROOT = Path(__file__).resolve().parent
SITE_DIR = SIM_ROOT / "site"  # holds the stand-in torch_npu package and its dist-info

ENABLE_VAR = "TORCHTITAN_NPU_SIM"
DEVICES_VAR = "TORCHTITAN_NPU_SIM_DEVICES"
MEMORY_GB_VAR = "TORCHTITAN_NPU_SIM_MEMORY_GB"


def sim_env(
    base_env: Mapping[str, str],
    *,
    devices: int | None = None,
    memory_gb: float | None = None,
) -> dict[str, str]:
    """Copy of ``base_env`` with the stand-in on PYTHONPATH and TORCHTITAN_NPU_SIM=1.

    The one way to get the simulated-NPU environment (tests build theirs on it).
    ``devices``/``memory_gb`` set TORCHTITAN_NPU_SIM_DEVICES/_MEMORY_GB when given.
    """
    env = dict(base_env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE_DIR) not in paths:
        paths.insert(0, str(SITE_DIR))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[ENABLE_VAR] = "1"
    if devices is not None:
        env[DEVICES_VAR] = str(devices)
    if memory_gb is not None:
        env[MEMORY_GB_VAR] = str(memory_gb)
    return env


def shell_exports() -> str:
    """The ``export`` line for a POSIX shell: what ``sim_env`` sets, keeping the shell's PYTHONPATH."""
    env = sim_env({})
    others = " ".join(f"{key}={value}" for key, value in env.items() if key != "PYTHONPATH")
    return f"export PYTHONPATH={env['PYTHONPATH']}${{PYTHONPATH:+:$PYTHONPATH}} {others}"


__all__ = ["SIM_ROOT", "SITE_DIR", "sim_env", "shell_exports"]
