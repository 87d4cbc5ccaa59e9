"""Which linears matmul_checks routes through its checked product, and that switching it back restores them.

torchtitan's own ``Linear`` (an ``nn.Linear`` subclass keeping its forward) is checked; a biased linear, a
subclass with its own forward (Float8Linear and the like compute otherwise) and any other module are not.
Outputs are compared with the same modules unpatched (torch's own forward).
"""

from __future__ import annotations

import pytest
import torch

from npu_inject import module_facts, selection
from npu_inject.errors import RunStopped
from npu_inject.ops.matmul_check import Ledger
from npu_inject.patches import matmul_checks
from npu_inject.patches.matmul_checks import install
from npu_inject.patching import PatchContext


class KeepsForward(torch.nn.Linear):
    """As torchtitan.models.common.linear.Linear: a configurable nn.Linear."""


class OwnForward(torch.nn.Linear):
    def forward(self, input):
        return super().forward(input) * 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.SiLU(), KeepsForward(16, 16, bias=False),
                               torch.nn.Linear(16, 16), OwnForward(16, 8, bias=False))


def test_bias_free_linears_keeping_nn_linears_forward_are_checked_and_restored():
    model, reference = _model(), _model()
    ledger = Ledger("cpu")
    count, skipped, restore = install([model], ledger)
    assert count == 2 and skipped == ["3 (bias)"]
    x = torch.randn(5, 8)
    ledger.checking = True
    y = model(x)
    y.sum().backward()
    assert torch.equal(y, reference(x))
    assert ledger.local_counts().tolist() == [0.0, 0.0, 2.0, 2.0]  # the two checked linears, forward and backward
    ledger.checking = False  # an unchecked step: torch's own forward, nothing counted
    ledger.reset()
    assert torch.equal(model(x), reference(x)) and ledger.local_counts().tolist() == [0.0, 0.0, 0.0, 0.0]
    restore()
    assert all("forward" not in vars(module) for module in model.modules())


def test_a_fault_on_a_step_that_is_not_checked_stops_at_start_up():
    """It would never be caused: a rehearsal of the recovery would pass for nothing."""
    selection.establish({"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_PATCHES": "+matmul_checks,+inject_faults",
                         "TORCHTITAN_NPU_FAULTS": "sdc_matmul@30", "TORCHTITAN_NPU_SDC_EVERY": "20"})
    try:
        ctx = PatchContext(patch_id="matmul_checks", device_kind="cpu",
                           declared_targets=module_facts.declared_names(matmul_checks),
                           options={"every": 10, "stop_after": 3, "window": 100})
        with pytest.raises(RunStopped, match=r"'sdc_matmul@30' is not a checked step \(every 20, from "
                                             r"TORCHTITAN_NPU_SDC_EVERY\), so the fault would never be caused"):
            matmul_checks.apply(ctx)
    finally:
        selection.forget()
