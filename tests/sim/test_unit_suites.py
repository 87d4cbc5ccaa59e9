"""Runs each simulator unit suite (tests/sim/unit/test_*.py) in its own sim process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = Path(__file__).resolve().parent / "unit"
SUITES = sorted(path.name for path in UNIT_DIR.glob("test_*.py"))


@pytest.mark.parametrize("suite", SUITES)
def test_unit_suite(suite: str, sim_child_env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(UNIT_DIR / suite), "-q", "-p", "no:cacheprovider"],
        env=sim_child_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{suite} failed in the simulator process (exit {result.returncode}):\n"
            f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}",
            pytrace=False,
        )
