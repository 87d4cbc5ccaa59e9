"""model_guard's decisions, on torchtitan's own config resolution and hand-made inputs."""

from __future__ import annotations

import os
import types

import pytest

from npu_inject.patches import model_guard


@pytest.mark.parametrize("args,expected", [
    (["--module", "qwen3_5", "--config", "qwen35_debugmodel"], ("qwen3_5", "qwen35_debugmodel")),
    (["--module=torchtitan.models.flux", "--config=flux_debugmodel"], ("flux", "flux_debugmodel")),
    (["--module", "torchtitan.models.kimi_k2_7.config_registry", "--config", "x"], ("kimi_k2_7", "x")),
    (["--training.steps", "3"], (None, None)),
])
def test_selection_reads_both_cli_forms(args, expected):
    assert model_guard.selection(args) == expected


def test_unsupported_family_names_what_it_needs_and_trainable_ones_pass():
    problem = model_guard.family_problem("qwen3_5", "npu")
    assert "flash-linear-attention" in problem and "target npu" in problem
    assert model_guard.family_problem("llama3", "cpu") is None
    assert model_guard.family_problem(None, "cpu") is None


def test_missing_optional_package_names_the_distribution_and_the_extra(monkeypatch):
    monkeypatch.setitem(model_guard.FAMILY_NEEDS, "llama3",
                        (model_guard.Needs("surely_not_installed_pkg", "not-installed", "testing"),))
    problem = model_guard.family_problem("llama3", "cpu")
    assert problem == "--module llama3 needs not-installed (testing), not installed: " + model_guard.EXTRA


def test_quantization_error_is_recognised_by_where_it_was_raised():
    from torchtitan.components.quantization import float8

    with pytest.raises((ImportError, ValueError)) as caught:  # no torchao, or no SM89 GPU
        float8.Float8LinearConverter(float8.Float8LinearConverter.Config())
    problem = model_guard.quantization_problem(caught.value, "llama3_debugmodel_float8", "npu")
    assert problem.startswith("--config llama3_debugmodel_float8 trains in float8"), problem
    assert model_guard.quantization_problem(ImportError("elsewhere"), "c", "npu") is None


def test_missing_local_data_is_named_with_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft = types.SimpleNamespace(dataloader=types.SimpleNamespace(
        load_dataset_kwargs={"data_files": "tests/assets/sft_test/data.json"}))
    problem = model_guard.data_problem(sft, "sft_debugmodel")
    assert os.path.join(str(tmp_path), "tests/assets/sft_test/data.json") in problem
    text = types.SimpleNamespace(dataloader=types.SimpleNamespace(dataset="c4_test"))
    assert "tools/make_assets.py" in model_guard.data_problem(text, "llama3_debugmodel")
    os.makedirs("tests/assets/c4_test")
    assert model_guard.data_problem(text, "llama3_debugmodel") is None
    image_text = types.SimpleNamespace(dataloader=types.SimpleNamespace(dataset="cc12m-test"))
    problem = model_guard.data_problem(image_text, "qwen35_debugmodel")
    assert os.path.join(str(tmp_path), "tests/assets/cc12m_test") in problem, problem
    assert "tools/make_mm_assets.py" in problem, problem
    os.makedirs("tests/assets/cc12m_test")
    assert model_guard.data_problem(image_text, "qwen35_debugmodel") is None


def test_cuda_only_optimizer_is_named_with_the_target():
    group = lambda name: types.SimpleNamespace(optimizer_name=name)  # noqa: E731
    muon = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[group("DistMuon"), group("AdamW")]))
    problem = model_guard.optimizer_problem(muon, "kimi_k2_5_debugmodel", "npu")
    assert problem.startswith("--config kimi_k2_5_debugmodel optimizes with DistMuon "
                              "(torchtitan.distributed.flex_shard)"), problem
    assert "target npu has no DistMuon" in problem, problem
    adamw = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[group("AdamW")]))
    assert model_guard.optimizer_problem(adamw, "llama3_debugmodel", "npu") is None
    assert model_guard.optimizer_problem(types.SimpleNamespace(), "c", "npu") is None
