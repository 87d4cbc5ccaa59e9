"""Child processes in the CANN emulation's venv (``.venv-cann``, or ``$CANN_EMU_VENV``), for tests/cann_emu.

``missing()`` says why the emulation cannot run here (tests/cann_emu/conftest.py skips with it);
``run_child`` / ``child_json`` run code in the venv under ``cann_env``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verification.cann_emu import BUILD_DIR, DEFAULT_VENV, cann_env  # noqa: E402

VENV = Path(os.environ.get("CANN_EMU_VENV") or REPO / DEFAULT_VENV)
PYTHON = VENV / "bin" / "python"
SETUP = "bash verification/cann_emu/setup.sh"


def missing() -> str | None:
    """Why the emulation cannot run here (its venv or its built libraries absent), or None."""
    if not PYTHON.exists():
        return f"the CANN emulation's venv {VENV} is absent (make it with `{SETUP}`)"
    for library in ("libascendcl.so", "libhccl.so"):
        if not (BUILD_DIR / library).exists():
            return f"the emulated CANN libraries are not built in {BUILD_DIR} (run `{SETUP}`)"
    return None


def run_child(code: str, *, timeout: int = 300, extra_env: dict | None = None, **config) -> subprocess.CompletedProcess:
    """Runs code in the emulation's venv, with the emulation's environment; returns the result."""
    env = cann_env({k: v for k, v in os.environ.items() if not k.startswith("CANN_EMU_")}, **config)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})
    return subprocess.run([str(PYTHON), "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def child_json(code: str, **kwargs) -> dict:
    """The JSON object the child prints last (it must exit 0)."""
    result = run_child(code, **kwargs)
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])
