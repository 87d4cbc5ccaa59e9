"""CANN emulation for tests (see README.md in this directory).

``cann_env`` gives the environment under which the real torch_npu wheel (installed in the
emulation's venv by setup.sh) loads the emulated CANN libraries from ``build/``::

    from verification.cann_emu import cann_env
    subprocess.run([".venv-cann/bin/python", ...], env=cann_env(os.environ), check=True)
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BUILD_DIR = ROOT / "build"
STEP_MARKS_DIR = ROOT / "step_marks"
DEFAULT_VENV = ".venv-cann"

DEVICES_VAR = "CANN_EMU_DEVICES"
SOC_VAR = "CANN_EMU_SOC"
MEMORY_GB_VAR = "CANN_EMU_MEMORY_GB"
CANN_VERSION_VAR = "CANN_EMU_CANN_VERSION"
COUNTS_VAR = "CANN_EMU_COUNTS"
DEFAULTS = {DEVICES_VAR: "8", SOC_VAR: "Ascend910B2", MEMORY_GB_VAR: "64", CANN_VERSION_VAR: "9.1.0"}
# Variables that would bring the simulated NPU's stand-in torch_npu (or a real CANN) instead.
CLEARED = ("TORCHTITAN_NPU_SIM", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH")


def cann_env(
    base_env: Mapping[str, str],
    *,
    devices: int | None = None,
    soc: str | None = None,
    memory_gb: float | None = None,
    counts: str | os.PathLike | None = None,
) -> dict[str, str]:
    """Copy of ``base_env`` with build/ first on LD_LIBRARY_PATH and the emulation's configuration.

    ``counts``: where each process writes what torch_npu asked of CANN, per training step
    (``{pid}`` in it becomes the process id; see counts.py). It also puts step_marks/ on PYTHONPATH,
    whose sitecustomize marks torchtitan's steps.

    Raises FileNotFoundError when the libraries are not built (run setup.sh).
    """
    if not (BUILD_DIR / "libascendcl.so").exists():
        raise FileNotFoundError(
            f"{BUILD_DIR / 'libascendcl.so'} is missing: run `bash verification/cann_emu/setup.sh` first"
        )
    env = {k: v for k, v in base_env.items() if k not in CLEARED}
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != str(BUILD_DIR)]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(BUILD_DIR), *paths])
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)
    if devices is not None:
        env[DEVICES_VAR] = str(devices)
    if soc is not None:
        env[SOC_VAR] = soc
    if memory_gb is not None:
        env[MEMORY_GB_VAR] = str(memory_gb)
    if counts is not None:
        env[COUNTS_VAR] = str(counts)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(STEP_MARKS_DIR)]
        env["PYTHONPATH"] = os.pathsep.join([str(STEP_MARKS_DIR), *paths])
    return env


def shell_exports(counts: str | None = None) -> str:
    """The lines for a POSIX shell: what ``cann_env`` sets, keeping the shell's own values."""
    cann_env({})  # fails early when nothing is built
    lines = [f"unset {' '.join(CLEARED)}",
             f"export LD_LIBRARY_PATH={BUILD_DIR}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"]
    lines += [f"export {key}=${{{key}:-{value}}}" for key, value in DEFAULTS.items()]
    if counts:
        lines += [f"export {COUNTS_VAR}={shlex.quote(counts)}",
                  f"export PYTHONPATH={STEP_MARKS_DIR}${{PYTHONPATH:+:$PYTHONPATH}}"]
    return "\n".join(lines)


__all__ = ["BUILD_DIR", "DEFAULT_VENV", "ROOT", "STEP_MARKS_DIR", "cann_env", "shell_exports"]
