"""The apply engine: lazy import, all or nothing, versions, requirements, strict, revert."""

from __future__ import annotations

import importlib
import sys

import pytest

from testkit import clean_env, fake_entry
from npu_inject import runtime
from npu_inject.errors import ConfigError, PatchError


def activate(registry_path: str, selection: str, **env) -> runtime.Runtime:
    return runtime.activate(clean_env(
        TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_REGISTRY=registry_path, TORCHTITAN_NPU_PATCHES=selection, **env,
    ))


def test_patch_module_is_imported_only_when_its_trigger_is(fake_target):
    path = fake_target({"fake_device": fake_entry("fake_patch_device", options={"scale": 3})})
    rt = activate(path, "fake_device")
    assert "fake_patch_device" not in sys.modules
    assert rt.report.patches["fake_device"].state == "pending"
    core = importlib.import_module("faketitan.core")
    assert "fake_patch_device" in sys.modules
    assert core.DEVICE == "cpu" and core.compute(1) == 20
    record = rt.report.patches["fake_device"]
    assert record.state == "applied" and record.trigger == "faketitan.core"
    assert record.notes == ["scale=3"]


def test_failed_apply_restores_everything_it_changed(fake_target):
    path = fake_target({"fake_broken": fake_entry("fake_patch_broken")})
    rt = activate(path, "fake_broken")
    core = importlib.import_module("faketitan.core")
    record = rt.report.patches["fake_broken"]
    assert record.state == "failed"
    assert "deliberate failure after two changes" in record.reason
    assert core.DEVICE == "cuda"
    assert core.Engine().run(2) == 4
    assert "run" in vars(core.Engine) and not hasattr(vars(core.Engine)["run"], "__wrapped__")


def test_missing_target_fails_and_restores(fake_target):
    path = fake_target({"fake_missing": fake_entry(
        "fake_patch_missing")})
    rt = activate(path, "fake_missing")
    core = importlib.import_module("faketitan.core")
    record = rt.report.patches["fake_missing"]
    assert record.state == "failed" and record.reason.startswith("target missing")
    assert "Engine.vanished" in record.reason
    assert core.DEVICE == "cuda"


def test_strict_mode_stops_at_a_failing_patch(fake_target):
    path = fake_target({"fake_broken": fake_entry("fake_patch_broken")})
    activate(path, "fake_broken", TORCHTITAN_NPU_STRICT="1")
    with pytest.raises(PatchError, match="fake_broken.*TORCHTITAN_NPU_STRICT=1"):
        importlib.import_module("faketitan.core")
    assert sys.modules.get("faketitan.core") is None or sys.modules["faketitan.core"].DEVICE == "cuda"


def test_unsupported_version_is_skipped_with_reason(fake_target):
    path = fake_target({"fake_device": fake_entry("fake_patch_device", supports={"torch": "<1.0"})})
    rt = activate(path, "fake_device")
    core = importlib.import_module("faketitan.core")
    record = rt.report.patches["fake_device"]
    assert record.state == "skipped"
    assert "outside the supported range <1.0" in record.reason
    assert core.DEVICE == "cuda"
    assert "fake_patch_device" not in sys.modules  # a skipped patch's code is never imported


def test_torch_npu_range_is_ignored_in_the_rehearsal(fake_target):
    path = fake_target({"fake_device": fake_entry("fake_patch_device", supports={"torch_npu": ">=99"})})
    rt = activate(path, "fake_device")
    importlib.import_module("faketitan.core")
    assert rt.report.patches["fake_device"].state == "applied"


def device_and_engine_patches() -> dict:
    """fake_engine (triggered by faketitan.other) requires fake_device (triggered by faketitan.core)."""
    return {
        "fake_device": fake_entry("fake_patch_device"),
        "fake_engine": fake_entry("fake_patch_engine", triggers=["faketitan.other"], requires=["fake_device"]),
    }


def test_requirements_apply_first_even_from_another_trigger(fake_target):
    import fake_patch_device

    fake_patch_device.APPLY_COUNT = 0
    path = fake_target(device_and_engine_patches())
    rt = activate(path, "fake_device,fake_engine")
    importlib.import_module("faketitan.other")  # fake_engine's trigger: pulls in fake_device's first
    assert [rt.report.patches[i].state for i in ("fake_device", "fake_engine")] == ["applied", "applied"]
    core = sys.modules["faketitan.core"]
    assert core.Engine().run(1) == 3 and core.Engine.build() == "patched"
    assert rt.apply("fake_device") is True and fake_patch_device.APPLY_COUNT == 1  # twice is a no-op


def test_revert_restores_exact_originals_for_every_descriptor_kind(fake_target):
    import faketitan.core as core

    before = dict(vars(core.Engine)), core.DEVICE, core.compute
    path = fake_target(device_and_engine_patches())
    rt = activate(path, "fake_device,fake_engine")
    importlib.import_module("faketitan.other")
    assert core.Engine().name == "patched"
    rt.revert("fake_device")  # reverts fake_engine first: it requires fake_device
    for key in ("run", "build", "create", "name"):
        assert vars(core.Engine)[key] is before[0][key], key
    assert core.DEVICE == before[1] and core.compute is before[2]
    assert rt.report.patches["fake_engine"].state == "reverted"


def test_disabled_and_wrong_target_patches_are_reported(fake_target):
    path = fake_target({
        "fake_device": fake_entry("fake_patch_device"),
        "fake_npu_only": fake_entry("fake_patch_device", runs_on=["npu"]),
    })
    rt = activate(path, "fake_device,fake_npu_only")
    assert rt.report.patches["fake_npu_only"].state == "disabled"
    assert "runs only on npu" in rt.report.patches["fake_npu_only"].reason
    assert rt.report.patches["triton_guard"].state == "disabled"  # not in the exact selection


def test_a_patch_of_a_package_that_is_not_installed_is_not_applicable_and_never_imported(fake_target):
    path = fake_target({
        "fake_device": fake_entry("fake_patch_device"),
        "fake_optional": fake_entry("fake_patch_broken", packages=["surely-not-installed-dist"]),
    })
    rt = activate(path, "fake_device,fake_optional")
    importlib.import_module("faketitan.core")  # the trigger of both
    record = rt.report.patches["fake_optional"]
    assert record.state == "not applicable"
    assert record.reason == ("surely-not-installed-dist is not installed; to use it: pip install "
                             "surely-not-installed-dist")
    assert "fake_patch_broken" not in sys.modules  # its module would raise when applied
    line = rt.report.summary_line()
    assert "not applicable 1: fake_optional (surely-not-installed-dist is not installed" in line
    assert "failed" not in line and "applied 1: fake_device" in line


def test_configuration_errors_come_before_any_patch(fake_target):
    path = fake_target({"fake_device": fake_entry("fake_patch_device", requires=["nonexistent"])})
    with pytest.raises(ConfigError, match="requires unknown patch 'nonexistent'"):
        activate(path, "fake_device")
    assert runtime.current() is None
    assert "fake_patch_device" not in sys.modules


def test_runtime_off_when_target_unset():
    assert runtime.activate(clean_env()) is None


def test_report_summary_and_json(fake_target, tmp_path):
    path = fake_target({"fake_broken": fake_entry("fake_patch_broken"),
                        "fake_device": fake_entry("fake_patch_device")})
    rt = activate(path, "fake_broken,fake_device")
    importlib.import_module("faketitan.core")
    line = rt.report.summary_line()
    assert line.startswith("npu_inject: target=cpu")
    assert "applied 1: fake_device" in line and "failed 1: fake_broken (RuntimeError" in line
    written = rt.write_report(str(tmp_path / "reports"))
    import json

    data = json.load(open(written))
    assert data["patches"]["fake_broken"]["state"] == "failed"
    assert data["versions"]["torch"] and data["target"] == "cpu"


def test_fallbacks_and_notes_recorded_inside_a_compiled_function_cause_no_recompile():
    """Patches record from inside compiled blocks (moe_dispatch's grouped matmul): traced, the
    membership test guarded on the list, and the trace's own append made every block recompile once,
    and again whenever any patch recorded something new."""
    import torch

    from npu_inject.patching import PatchContext

    context, other = PatchContext("p", "cpu", {}), PatchContext("q", "cpu", {})
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    @torch.compile(fullgraph=True, backend=counting_backend)
    def block(x):
        context.fallback(f"reference path for {x.dim()}-D input")
        context.note("a note")
        return x * 2

    torch._dynamo.reset()
    try:
        for step in range(3):
            torch.testing.assert_close(block(torch.ones(3)), torch.full((3,), 2.0))
            context.fallback(f"recorded eagerly at step {step}")
            other.fallback(f"another patch at step {step}")
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    assert context.fallbacks == ["reference path for 1-D input", *(f"recorded eagerly at step {s}" for s in range(3))]
    assert context.notes == ["a note"]


@pytest.mark.parametrize("faults, message", [
    ("nan_los@3", "unknown fault 'nan_los' (known: nan_loss, loss_spike, bitflip_param, sdc_matmul, sdc_expert, kill, hang, "
     "kill_in_forward, "
     "hang_in_forward, uce_in_forward, uce_in_state, uce_in_update, link_error, stuck_collective)"),
    ("nan_loss@0", "the step must be a training step >= 1"),
    ("nan_loss", "the step must be a training step >= 1"),
    ("nan_loss@3:rnk=1", "'rnk=1' is not rank=R"),
])
def test_a_bad_fault_is_one_configuration_error_naming_it(faults, message):
    from npu_inject import settings

    with pytest.raises(ConfigError) as raised:
        settings.load(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_FAULTS=faults))
    assert str(raised.value).startswith(f"TORCHTITAN_NPU_FAULTS: {faults.split(',')[0]!r}: {message}")


def test_faults_asked_for_without_the_patch_that_causes_them_stop_at_start_up():
    from npu_inject import selection, settings

    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_FAULTS="nan_loss@3:rank=1,kill@5:rank=0,hang@7")
    assert settings.load(env).faults == (settings.Fault("nan_loss", 3, 1), settings.Fault("kill", 5, 0),
                                         settings.Fault("hang", 7, None))
    with pytest.raises(ConfigError, match="patch inject_faults is not enabled; add \\+inject_faults"):
        selection.make(env)
    assert selection.make({**env, "TORCHTITAN_NPU_PATCHES": "+inject_faults"}).enabled["inject_faults"]


def test_wrap_overrides_reaches_overrides_now_and_later_and_reverts(tmp_path, monkeypatch):
    """A base method wrapped alone would silently miss a subclass's own override (torchft's trainer)."""
    from npu_inject.patching import PatchContext

    (tmp_path / "trainers_mod.py").write_text(
        "class Base:\n"
        "    def step(self):\n        return ['base']\n"
        "class Early(Base):\n"
        "    def step(self):\n        return ['early']\n"
        "class Calls(Base):\n"
        "    def step(self):\n        return super().step() + ['calls']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import trainers_mod

    seen = []

    def wrapper(original, self):
        seen.append(type(self).__name__)
        return original(self)

    context = PatchContext("p", "cpu", {}, declared_targets=("trainers_mod:Base.step",))
    context.wrap_overrides("Base.step", wrapper)

    class Late(trainers_mod.Base):
        def step(self):
            return ["late"]

    assert [cls().step() for cls in (trainers_mod.Base, trainers_mod.Early, Late)] == [["base"], ["early"], ["late"]]
    assert seen == ["Base", "Early", "Late"]
    seen.clear()
    assert trainers_mod.Calls().step() == ["base", "calls"] and seen == ["Calls", "Calls"]  # nested: wrappers tolerate it
    context.restore()
    seen.clear()

    class After(trainers_mod.Base):
        def step(self):
            return ["after"]

    for cls in (trainers_mod.Base, trainers_mod.Early, trainers_mod.Calls, Late, After):
        cls().step()
    assert seen == [] and "__init_subclass__" not in vars(trainers_mod.Base)
    sys.modules.pop("trainers_mod")


def test_patches_restored_out_of_order_leave_nothing_of_either_behind(tmp_path, monkeypatch):
    """Patch b wrapped on top of a; restoring a first, then b, puts a's wrapper and subclass hook back (b's
    originals): they must do nothing of a's (seen in CI as a reverted runtime's wrapper on a later Trainer)."""
    from npu_inject.patching import PatchContext

    (tmp_path / "stacked_mod.py").write_text("class Base:\n    def step(self):\n        return ['base']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import stacked_mod

    contexts = {name: PatchContext(name, "cpu", {}, declared_targets=("stacked_mod:Base.step",)) for name in "ab"}
    for name, context in contexts.items():
        context.wrap_overrides("Base.step", lambda original, self, name=name: original(self) + [name])
    assert stacked_mod.Base().step() == ["base", "a", "b"]
    contexts["a"].restore()
    contexts["b"].restore()

    class Later(stacked_mod.Base):
        def step(self):
            return ["later"]

    assert stacked_mod.Base().step() == ["base"] and Later().step() == ["later"]
    contexts["a"].wrap_overrides("Base.step", lambda original, self: original(self) + ["a again"])
    assert stacked_mod.Base().step() == ["base", "a again"] and Later().step() == ["later", "a again"]
    contexts["a"].restore()
    sys.modules.pop("stacked_mod")


@pytest.mark.parametrize("raw", ["0", "ten", "-3", "2.5"])
def test_a_bad_check_interval_is_one_configuration_error_naming_it(raw):
    from npu_inject import settings

    with pytest.raises(ConfigError, match=f"TORCHTITAN_NPU_SDC_EVERY={raw!r} is not valid; use a whole number"):
        settings.load(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_SDC_EVERY=raw))
    assert settings.load(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_SDC_EVERY="25")).sdc_every == 25


@pytest.mark.parametrize("variables, message", [
    ({"TORCHTITAN_NPU_SDC_EVERY": "5"}, "TORCHTITAN_NPU_SDC_EVERY is set but patch matmul_checks is not enabled"),
    ({"TORCHTITAN_NPU_FAULTS": "sdc_matmul@5", "TORCHTITAN_NPU_PATCHES": "+inject_faults"},
     "'sdc_matmul@5' corrupts a checked matmul, but patch matmul_checks is not enabled"),
])
def test_what_only_matmul_checks_reads_stops_at_start_up_without_it(variables, message):
    """A variable that silently does nothing, a fault never caused: both are configuration errors."""
    from npu_inject import selection

    env = clean_env(TORCHTITAN_NPU="cpu", **variables)
    with pytest.raises(ConfigError, match=message):
        selection.make(env)
    patches = variables.get("TORCHTITAN_NPU_PATCHES", "") + ",+matmul_checks"
    assert selection.make({**env, "TORCHTITAN_NPU_PATCHES": patches.lstrip(",")}).enabled["matmul_checks"]
