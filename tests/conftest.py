"""Shared fixtures: a clean runtime per test, subprocess helpers, a fake target package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = os.path.join(REPO, "tests", "plugins")


@pytest.fixture(autouse=True)
def _clean_runtime():
    """Every test starts and ends with no active runtime (patches reverted)."""
    from npu_inject import runtime

    runtime.deactivate()
    yield
    runtime.deactivate()


def clean_env(**overrides: str) -> dict[str, str]:
    """The current environment without TORCHTITAN_NPU*, plus overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}
    env.update(overrides)
    return env


def run_python(code: str, env: dict[str, str], cwd: str | None = None, timeout: int = 300):
    """A fresh interpreter (site-packages .pth files processed as in real use)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def fake_target(tmp_path, monkeypatch):
    """A throwaway package 'faketitan' plus a registry whose patches live in tests/plugins.

    Returns a function writing the registry (dict of patch id -> entry) and giving its path.
    """
    package = tmp_path / "faketitan"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text(textwrap.dedent('''
        DEVICE = "cuda"

        def compute(x):
            return x + 1

        class Engine:
            def run(self, x):
                return x * 2

            @staticmethod
            def build():
                return "built"

            @classmethod
            def create(cls):
                return cls

            @property
            def name(self):
                return "engine"
    '''))
    (package / "other.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(PLUGINS)
    for name in list(sys.modules):
        if name.startswith(("faketitan", "fake_patch_")):
            monkeypatch.delitem(sys.modules, name)

    def write_registry(patches: dict) -> str:
        path = tmp_path / "registry.json"
        path.write_text(json.dumps({"schema": 1, "patches": patches}))
        return str(path)

    return write_registry


def fake_entry(module: str, triggers=("faketitan.core",),
               targets=("faketitan.core:DEVICE", "faketitan.core:compute"), **extra) -> dict:
    entry = {
        "module": module,
        "triggers": list(triggers),
        "targets": list(targets),
        "supports": {},
        "requires": [],
        "default": True,
        "options": {},
        "description": f"test patch {module}",
    }
    entry.update(extra)
    return entry
