"""The context_parallel patch's start-up check: a Ulysses CP degree that does not divide the heads stops at once."""

from __future__ import annotations

import importlib
import json

import pytest

from testkit import clean_env
from npu_inject import runtime
from npu_inject.errors import ConfigError


@pytest.fixture
def trainer_with_scheme(tmp_path):
    def activate(scheme: str):
        registry = tmp_path / "registry.json"
        registry.write_text(json.dumps({"patches": {"context_parallel": {"options": {"scheme": scheme}}}}))
        rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_REGISTRY=str(registry),
                                        TORCHTITAN_NPU_PATCHES="device,attention,context_parallel"),
                              install_hooks=False)
        for module in ("torchtitan.tools.utils", "torchtitan.models.common.decoder", "torchtitan.trainer"):
            importlib.import_module(module)
        for patch_id in ("device", "attention", "context_parallel"):
            assert rt.apply(patch_id), rt.report.patches[patch_id]
        activated.append(rt)
        return importlib.import_module("torchtitan.trainer")

    activated: list = []
    yield activate
    for rt in activated:
        rt.revert_all()


def _config(trainer, cp: int, tp: int = 1):
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.models.llama3 import model_registry

    return trainer.Trainer.Config(model_spec=model_registry("debugmodel"),
                                  parallelism=ParallelismConfig(context_parallel_degree=cp,
                                                                tensor_parallel_degree=tp))


def test_ulysses_with_indivisible_heads_stops_at_config(trainer_with_scheme):
    trainer = trainer_with_scheme("ulysses")
    with pytest.raises(ConfigError, match=r"16 query heads .* context_parallel_degree=3.*'allgather'"):
        _config(trainer, cp=3)
    with pytest.raises(ConfigError, match=r"leave 2 per rank"):
        _config(trainer, cp=4, tp=8)
    _config(trainer, cp=4)


def test_auto_accepts_any_degree(trainer_with_scheme):
    trainer = trainer_with_scheme("auto")
    _config(trainer, cp=3)


def test_a_model_module_imported_while_the_patch_applied_gets_the_original_back_on_revert(monkeypatch):
    """A parallelize module first imported while context_parallel applied binds the wrapped shared definition;
    reverting gave only the shared definition back, and the model kept the wrapper (test_catalog's revert check
    then failed in whichever test ran next in that process)."""
    import sys

    import torchtitan.distributed.context_parallel as shared

    from npu_inject import registry, selection

    original = shared.apply_cp_to_forward
    monkeypatch.delitem(sys.modules, "torchtitan.models.llama3.parallelize", raising=False)
    catalog = registry.load(None, entry_points=False)
    involved = selection.apply_order(catalog, ["context_parallel"])
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=",".join(involved)),
                          install_hooks=False)
    for required in involved:
        for trigger in catalog.patches[required].triggers:
            importlib.import_module(trigger)
        assert rt.apply(required), rt.report.patches[required].reason
    assert "torchtitan.models.llama3.parallelize" not in sys.modules  # imported only now, as a model would be
    model = importlib.import_module("torchtitan.models.llama3.parallelize")
    assert model.apply_cp_to_forward is not original
    rt.revert_all()
    assert model.apply_cp_to_forward is original
