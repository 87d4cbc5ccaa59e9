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
    count, experts, skipped, restore = install([model], ledger)
    assert count == 2 and experts == 0 and skipped == ["3 (bias)", "4 (OwnForward's own forward)"]
    x = torch.randn(5, 8)
    ledger.checking = True
    y = model(x)
    y.sum().backward()
    assert torch.equal(y, reference(x))
    assert ledger.local_counts().tolist() == [0.0, 0.0, 2.0, 2.0, 0.0]  # the two checked linears, forward and backward
    ledger.checking = False  # an unchecked step: torch's own forward, nothing counted
    ledger.reset()
    assert torch.equal(model(x), reference(x)) and ledger.local_counts().tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    restore()
    assert all("forward" not in vars(module) for module in model.modules())


def test_a_call_the_check_does_not_take_runs_unchecked_and_is_counted():
    """A transposed (non-contiguous) input: torch's own forward, and the ledger counts the call."""
    model, reference = _model(), _model()
    ledger = Ledger("cpu")
    install([model[0]], ledger)
    x = torch.randn(8, 5).t()
    ledger.checking = True
    assert torch.equal(model[0](x), reference[0](x))
    assert ledger.local_counts().tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def _redistributing(linear, scale_in: float, shift_out: float):
    """torchtitan's Module.parallelize, in miniature: the instance forward wraps the bound nn.Linear.forward."""
    fn = linear.forward

    def forward_with_redistribution(*args, **kwargs):
        outputs = fn(args[0] * scale_in, **kwargs)
        return outputs + shift_out

    linear.forward = forward_with_redistribution
    return linear


def test_a_linear_inside_torchtitans_redistributing_forward_is_checked_with_the_redistributions_around_it():
    """The check takes the bound forward's place inside the wrapper, so what the wrapper does to the inputs and
    outputs still happens; restoring puts the bound forward back. A wrapper of another kind is not entered."""
    torch.manual_seed(0)
    model = _redistributing(torch.nn.Linear(8, 16, bias=False), 2.0, 1.0)
    torch.manual_seed(0)
    reference = _redistributing(torch.nn.Linear(8, 16, bias=False), 2.0, 1.0)
    wrapper = model.forward
    ledger = Ledger("cpu")
    count, _, skipped, restore = install([model], ledger)
    assert count == 1 and skipped == [] and model.forward is wrapper
    x = torch.randn(5, 8)
    ledger.checking = True
    assert torch.equal(model(x), reference(x))
    assert ledger.local_counts().tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    restore()
    ledger.reset()
    assert torch.equal(model(x), reference(x)) and ledger.local_counts().tolist() == [0.0] * 5

    other = torch.nn.Linear(8, 16, bias=False)
    other.forward = lambda input: torch.nn.Linear.forward(other, input)
    count, _, skipped, _ = install([other], ledger)
    assert count == 0 and skipped == [
        " (forward wrapped by test_a_linear_inside_torchtitans_redistributing_forward_is_checked_with_the_"
        "redistributions_around_it.<locals>.<lambda>)"]


def _experts():
    from torchtitan.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(GroupedExperts.Config(dim=64, hidden_dim=96, num_experts=4))
    for weight in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
        torch.nn.init.normal_(weight, std=0.05)
    return experts


def test_moe_experts_grouped_products_are_checked_bit_for_bit_and_restored():
    """torchtitan's GroupedExperts: its three grouped products per call, forward and backward, checked through its
    own _grouped_mm seam; the output and every gradient equal an unpatched copy's bit for bit."""
    experts, reference = _experts(), _experts()
    ledger = Ledger("cpu")
    count, grouped, skipped, restore = install([experts], ledger)
    assert (count, grouped, skipped) == (0, 1, [])
    tokens = torch.tensor([5, 0, 9, 10])
    x = torch.randn(24, 64, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    ledger.checking = True
    ledger.reset()
    y, y_reference = experts(x, tokens), reference(x_reference, tokens)
    y.sum().backward()
    y_reference.sum().backward()
    assert torch.equal(y, y_reference) and torch.equal(x.grad, x_reference.grad)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        assert torch.equal(getattr(experts, name).grad, getattr(reference, name).grad), name
    assert ledger.local_counts().tolist() == [0.0, 0.0, 3.0, 3.0, 0.0]
    restore()
    assert "_grouped_mm" not in vars(experts)


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
