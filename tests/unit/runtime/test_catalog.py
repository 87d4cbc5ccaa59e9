"""Every shipped patch module states its description and TARGETS, touches exactly them, and reverts exactly.

These run the real patches against the installed torchtitan, in this process,
with the runtime driven by hand (no import hooks).
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest

from testkit import clean_env, run_python
from npu_inject import module_facts, patching, registry, runtime, selection
from npu_inject.commands import cli

CATALOG = registry.load(None, entry_points=False)
SHIPPED = sorted(CATALOG.patches)


@pytest.mark.parametrize("patch_id", SHIPPED)
def test_patch_module_states_what_only_it_knows_and_the_registry_the_rest(patch_id):
    spec = CATALOG.patches[patch_id]
    module = importlib.import_module(spec.module)
    for copy in ("TRIGGERS", "SUPPORTS", "REQUIRES", "DESCRIPTION"):
        assert not hasattr(module, copy), f"{spec.module}.{copy} restates registry.json or the docstring"
    assert module_facts.declared_names(module) == tuple(target.name for target in spec.targets)
    assert callable(module.apply)
    assert callable(getattr(module, "revert", lambda ctx: None))
    for trigger in spec.triggers:
        assert importlib.util.find_spec(trigger.split(".")[0]) is not None


def test_npu_inject_list_shows_each_module_docstrings_first_line(capsys):
    assert cli.main(["list", "--json"]) == 0
    shown = {row["id"]: row["description"] for row in json.loads(capsys.readouterr().out)["patches"]}
    for patch_id in SHIPPED:
        docstring = inspect.getdoc(importlib.import_module(CATALOG.patches[patch_id].module))
        assert docstring, f"{patch_id}: a patch module starts with a docstring"
        assert shown[patch_id] == docstring.splitlines()[0], patch_id
        assert "0.3.0" not in docstring, f"{patch_id}: the supported versions live in registry.json"


def test_registry_json_states_no_default():
    document = registry.read_json(registry.PACKAGED_REGISTRY)
    named_ranges = list(document.get("ranges", {}).values())
    for patch_id, entry in document["patches"].items():
        for key, value in entry.items():
            assert value != registry.key_default(key), f"registry.json: {patch_id}.{key} states its default"
        assert entry.get("module") != f"{registry.PATCH_PACKAGE}.{patch_id}", f"{patch_id}.module is derived"
        assert entry.get("supports") not in named_ranges, f"{patch_id}.supports: name the range instead"


def _raw(target: str):
    module_name, qualname = target.split(":")
    if qualname == "*":
        return None
    owner, attribute = patching.resolve_owner(target)
    return vars(owner).get(attribute, patching._MISSING) if inspect.isclass(owner) else getattr(owner, attribute)


def _original(value):
    """``value`` as its module defined it: a subclass created after a required patch's ``wrap_overrides`` applied
    (step_owner's on Trainer.train_step, then torchft's trainer imported) is wrapped as it is created, so its
    first snapshot is that patch's forwarding function, which reverting replaces by the function it wraps."""
    code = getattr(value, "__code__", None)
    if code is not None and code.co_filename == patching.__file__ and hasattr(value, "__wrapped__"):
        return value.__wrapped__
    return value


@pytest.mark.parametrize("patch_id", SHIPPED)
def test_apply_then_revert_restores_originals(patch_id):
    spec = CATALOG.patches[patch_id]
    if "cpu" not in spec.runs_on:
        sim_test = Path(__file__).resolve().parents[2] / "sim" / "unit" / f"test_{patch_id}.py"
        assert sim_test.exists(), f"{patch_id} does not run on cpu: give it a revert test on the simulated NPU"
        pytest.skip(f"{patch_id} runs on npu only: its revert is tested in {sim_test.name} on the simulated NPU")
    involved = selection.apply_order(CATALOG, [patch_id])
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=",".join(involved)),
                          install_hooks=False)
    # Each patch's triggers are imported once its requirements apply (qwen3_5's model module
    # imports only while gated_delta_net serves fla); a target's first snapshot is its original.
    before = {}
    for required in involved:
        for trigger in CATALOG.patches[required].triggers:
            importlib.import_module(trigger)
        for target in CATALOG.patches[required].targets:
            before.setdefault(target.name, _original(_raw(target.name)))
        assert rt.apply(required), rt.report.patches[required].reason
    assert rt.report.patches[patch_id].state == "applied"
    touched = rt.states[patch_id].context.touched()
    untouched = [target.name for target in spec.targets if not target.condition and target.name not in touched]
    assert not untouched, (f"{patch_id} declares {untouched} in TARGETS but did not change them; mark a target "
                           "that is changed only sometimes as ('module:qualname', 'when ...')")
    rt.revert_all()
    for target, original in before.items():
        assert _raw(target) is original, f"{target} not restored by reverting {patch_id}"
    assert all(rt.report.patches[i].state == "reverted" for i in involved)


def test_triton_guard_lets_torchtitan_import_without_triton():
    """sys.modules['triton'] = None makes triton unimportable, as on a machine without it."""
    code = """
        import sys
        sys.modules["triton"] = None
        import torchtitan.trainer
        from torchtitan.distributed.minimal_async_ep import kernels
        from npu_inject import runtime
        print(runtime.current().report.patches["triton_guard"].fallbacks[0][:40])
        try:
            kernels.fill_dispatch_metadata()
        except ImportError as exc:
            print("ImportError:", exc)
    """
    guarded = run_python(code, clean_env(TORCHTITAN_NPU="cpu"))
    assert guarded.returncode == 0, guarded.stderr
    assert "triton is not importable: MinimalAsyncEP" in guarded.stdout
    assert "kernels.fill_dispatch_metadata needs triton, which is not importable here; install triton" in guarded.stdout
    unguarded = run_python(code, clean_env())
    assert unguarded.returncode != 0
    assert "import of triton halted" in unguarded.stderr


def test_cuda_graphs_patch_lets_expert_parallel_configs_validate():
    code = """
        from torchtitan.config import ConfigManager
        config = ConfigManager().parse_args(["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
                                             "--parallelism.expert_parallel_degree", "2"])
        print("disable_cuda_graphs", config.training.disable_cuda_graphs)
    """
    patched = run_python(code, clean_env(TORCHTITAN_NPU="cpu"))
    assert patched.returncode == 0, patched.stderr[-2000:]
    assert "disable_cuda_graphs True" in patched.stdout
    upstream = run_python(code, clean_env())
    assert upstream.returncode != 0
    assert "CUDA graphs support only expert parallel token" in upstream.stderr  # tyro wraps the message
