"""The stand-in's safety catch and path helpers (no simulator imported here)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from verification.sim_npu import SITE_DIR, sim_env  # noqa: E402


def test_import_without_opt_in_raises_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHTITAN_NPU_SIM", raising=False)
    monkeypatch.syspath_prepend(str(SITE_DIR))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(ImportError, match="TORCHTITAN_NPU_SIM=1"):
        importlib.import_module("torch_npu")
    assert "torch_npu" not in sys.modules


def test_dist_info_reports_version_on_the_site_path() -> None:
    found = [d for d in importlib.metadata.distributions(path=[str(SITE_DIR)]) if d.metadata["Name"] == "torch_npu"]
    assert [d.version for d in found] == ["2.14.0"]


def test_sim_env_prepends_site_dir_once_and_opts_in() -> None:
    env = sim_env({"PYTHONPATH": "/somewhere", "KEEP": "1"}, devices=4, memory_gb=2)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/somewhere"]
    assert env["TORCHTITAN_NPU_SIM"] == "1"
    assert env["TORCHTITAN_NPU_SIM_DEVICES"] == "4"
    assert env["TORCHTITAN_NPU_SIM_MEMORY_GB"] == "2"
    assert env["KEEP"] == "1"
    assert sim_env(env)["PYTHONPATH"] == env["PYTHONPATH"]
    assert "TORCHTITAN_NPU_SIM_DEVICES" not in sim_env({})


def test_env_cli_prints_export_line() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "verification" / "sim_npu" / "env.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    line = result.stdout.strip()
    assert line.startswith(f"export PYTHONPATH={SITE_DIR}")
    assert line.endswith("TORCHTITAN_NPU_SIM=1")


def test_configuration_comes_from_the_environment(sim_child_env: dict[str, str]) -> None:
    env = dict(sim_child_env, TORCHTITAN_NPU_SIM_DEVICES="3", TORCHTITAN_NPU_SIM_MEMORY_GB="0.5")
    code = (
        "import torch, torch_npu; "
        "print(torch.npu.device_count(), torch.npu.get_device_properties(0).total_memory, "
        "torch_npu.__simulated__)"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["3", str(1 << 29), "True"]
