"""In-process simulator tests: collected only inside a simulator process.

tests/sim/test_unit_suites.py runs each test_*.py here in a child pytest with
TORCHTITAN_NPU_SIM=1; a plain `pytest tests` process skips them (and so never
imports the stand-in torch_npu, which changes process-wide torch state).
Run one directly with:
    eval "$(python verification/sim_npu/env.py)"; python -m pytest tests/sim/unit -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SIM_ACTIVE = os.environ.get("TORCHTITAN_NPU_SIM") == "1"

if not SIM_ACTIVE:
    collect_ignore_glob = ["test_*.py"]
else:
    _site = Path(__file__).resolve().parents[3] / "verification" / "sim_npu" / "site"
    if str(_site) not in sys.path:
        sys.path.insert(0, str(_site))
    import torch_npu  # noqa: F401


@pytest.fixture(autouse=True)
def _back_on_device_zero():
    import torch

    yield
    torch.npu.set_device(0)


@pytest.fixture
def npu_patch():
    """``npu_patch(patch_id)``: the runtime activated for the NPU target with that patch and the patches it
    requires alone, their triggers imported and the patches applied (required ones first); the runtime is
    deactivated after the test."""
    import importlib

    from npu_inject import registry, runtime

    def activate(patch_id: str):
        patches = registry.load(None, entry_points=False).patches
        selected = [*patches[patch_id].requires, patch_id]
        rt = runtime.activate({"TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_PATCHES": ",".join(selected)},
                              install_hooks=False)
        for each in selected:
            for trigger in patches[each].triggers:
                importlib.import_module(trigger)
            assert rt.apply(each), rt.report.patches[each].reason
        return rt

    yield activate
    runtime.deactivate()
