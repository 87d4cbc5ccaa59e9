"""The optimizer patch: implementation choice by probing, kept across checkpoint loads.

Expected values come from plain ``torch.optim.AdamW`` built without the runtime; the
"device without fused kernels" is an AdamW subclass whose fused/foreach paths raise or
compute garbage, which is what a backend missing (or mis-implementing) a kernel does.
"""

from __future__ import annotations

import pytest
import torch

from npu_inject import runtime

ADAMW_KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class AdamWWithoutFused(torch.optim.AdamW):
    """AdamW on a backend with no fused kernel (what torch raises for a missing kernel)."""

    def step(self, closure=None):
        if any(group["fused"] for group in self.param_groups):
            raise NotImplementedError("Could not run 'aten::_fused_adamw_' with arguments from the 'PrivateUse1' backend")
        return super().step(closure)


class AdamWWithBrokenForeach(AdamWWithoutFused):
    """A foreach kernel that runs but returns wrong numbers."""

    def step(self, closure=None):
        result = super().step(closure)
        if any(group["foreach"] for group in self.param_groups):
            with torch.no_grad():
                for group in self.param_groups:
                    for param in group["params"]:
                        param.add_(1.0)
        return result


def _activate(**env):
    return runtime.activate({"TORCHTITAN_NPU": "cpu", **env})


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _config(implementation, name="AdamW"):
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    return OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=dict(ADAMW_KWARGS))],
        implementation=implementation,
    )


def _train(model, optimizer, steps=4, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(3, 6, generator=generator)).pow(2).sum().backward()
        optimizer.step()


def test_probe_accepts_cpu_fused_and_rejects_bf16_states():
    from npu_inject.patches import optimizer as patch

    cpu = torch.device("cpu")
    assert patch.probe(torch.optim.AdamW, ADAMW_KWARGS, cpu, torch.float32, "fused") is None
    assert patch.probe(torch.optim.AdamW, ADAMW_KWARGS, cpu, torch.float32, "foreach") is None
    reason = patch.probe(torch.optim.AdamW, ADAMW_KWARGS, cpu, torch.float32, "fused_opt_states_bf16")
    assert reason is not None and "RuntimeError" in reason
    missing = patch.probe(AdamWWithoutFused, ADAMW_KWARGS, cpu, torch.float32, "fused")
    assert missing.startswith("NotImplementedError") and "_fused_adamw_" in missing
    wrong = patch.probe(AdamWWithBrokenForeach, ADAMW_KWARGS, cpu, torch.float32, "foreach")
    assert wrong is not None and "differs from the for-loop reference" in wrong


def test_candidates_never_upgrade():
    from npu_inject.patches.optimizer import candidates

    assert candidates("fused") == ("fused", "foreach", "for-loop")
    assert candidates("for-loop") == ("for-loop",)
    with pytest.raises(ValueError):
        candidates("fast")


def test_cpu_keeps_fused_and_trains_like_plain_adamw():
    _activate()
    model, reference = _model(), _model()
    container = _config("fused").build(model_parts=[model])
    assert [g["fused"] for g in container.optimizers[0].param_groups] == [True]
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW_KWARGS, fused=True)
    _train(model, container)
    _train(reference, plain)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    record = runtime.current().report.patches["optimizer"]
    assert record.state == "applied"
    assert "optimizer implementation on cpu: fused (configured: fused)" in record.notes
    assert record.fallbacks == []


def test_bf16_states_fall_back_to_fused_on_cpu_and_say_so():
    _activate()
    container = _config("fused_opt_states_bf16").build(model_parts=[_model()])
    _train(container.model_parts[0], container, steps=1)
    optimizer = container.optimizers[0]
    assert optimizer.param_groups[0]["fused"] is True
    # fp32 states: torchtitan's bf16 state hook was not registered for an unsupported kernel.
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    record = runtime.current().report.patches["optimizer"]
    assert any("'fused_opt_states_bf16' does not run on cpu" in f and "using 'fused'" in f
               for f in record.fallbacks), record.fallbacks


def test_missing_fused_kernel_picks_foreach(monkeypatch):
    _activate()
    from torchtitan.components.optimizer import OptimizersContainer

    original = OptimizersContainer._resolve_optimizer_factory
    monkeypatch.setattr(
        OptimizersContainer, "_resolve_optimizer_factory",
        staticmethod(lambda name: AdamWWithoutFused if name == "AdamW" else original(name)),
    )
    model, reference = _model(), _model()
    container = _config("fused").build(model_parts=[model])
    group = container.optimizers[0].param_groups[0]
    assert (group["fused"], group["foreach"]) == (False, True)
    _train(model, container)  # would raise NotImplementedError with fused=True
    _train(reference, torch.optim.AdamW(reference.parameters(), **ADAMW_KWARGS, foreach=True))
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    record = runtime.current().report.patches["optimizer"]
    assert "optimizer implementation on cpu: foreach (configured: fused)" in record.notes
    assert any("'fused' does not run on cpu" in f and "_fused_adamw_" in f for f in record.fallbacks)


def test_wrong_results_skip_to_for_loop(monkeypatch):
    _activate()
    from torchtitan.components.optimizer import OptimizersContainer

    monkeypatch.setattr(OptimizersContainer, "_resolve_optimizer_factory",
                        staticmethod(lambda name: AdamWWithBrokenForeach))
    container = _config("fused").build(model_parts=[_model()])
    group = container.optimizers[0].param_groups[0]
    assert (group["fused"], group["foreach"]) == (False, False)


def test_loading_a_checkpoint_keeps_the_chosen_implementation(monkeypatch):
    """A state dict written where fused kernels exist must not switch them back on."""
    _activate()
    from torchtitan.components.optimizer import OptimizersContainer

    writer = _config("fused").build(model_parts=[_model()])  # plain CPU: fused
    _train(writer.model_parts[0], writer, steps=2)
    saved = writer.state_dict()
    assert saved["param_groups.0.weight.fused"] is True

    monkeypatch.setattr(OptimizersContainer, "_resolve_optimizer_factory",
                        staticmethod(lambda name: AdamWWithoutFused))
    reader = _config("fused").build(model_parts=[_model()])
    reader.load_state_dict(saved)
    optimizer = reader.optimizers[0]
    assert all((g["fused"], g["foreach"]) == (False, True) for g in optimizer.param_groups)
    # foreach keeps step counters on the host; the loaded values are the writer's.
    for state in optimizer.state.values():
        assert state["step"].device.type == "cpu" and state["step"].item() == 2.0
    _train(reader.model_parts[0], reader, steps=1)  # runs: fused is off again
    notes = runtime.current().report.patches["optimizer"].notes
    assert any("group 0 fused=True -> False" in n for n in notes), notes


def test_revert_restores_upstream():
    from torchtitan.components.optimizer.optimizer import OptimizersContainer

    upstream_init = OptimizersContainer.__dict__["__init__"]
    upstream_load = OptimizersContainer.__dict__["load_state_dict"]
    _activate()
    assert OptimizersContainer.__dict__["__init__"] is not upstream_init
    runtime.deactivate()
    assert OptimizersContainer.__dict__["__init__"] is upstream_init
    assert OptimizersContainer.__dict__["load_state_dict"] is upstream_load
