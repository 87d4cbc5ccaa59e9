"""Start-up validation (patch parallel_checks): settings the target cannot run stop while the config is built."""

from __future__ import annotations

import importlib

import pytest

from testkit import clean_env
from npu_inject import runtime
from npu_inject.errors import ConfigError


@pytest.fixture
def trainer_module():
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="parallel_checks"),
                          install_hooks=False)
    trainer = importlib.import_module("torchtitan.trainer")
    assert rt.apply("parallel_checks"), rt.report.patches["parallel_checks"]
    yield rt, trainer
    rt.revert_all()


def test_async_tensor_parallel_is_rejected_with_a_report_note(trainer_module):
    rt, trainer = trainer_module
    from torchtitan.config.configs import CompileConfig

    with pytest.raises(ConfigError, match="enable_async_tensor_parallel.*symm_mem.*'cpu'"):
        trainer.Trainer.Config(compile=CompileConfig(enable=True, enable_async_tensor_parallel=True))
    assert any("async" in note for note in rt.report.patches["parallel_checks"].notes)


def test_supported_settings_pass(trainer_module):
    _, trainer = trainer_module
    from torchtitan.config.configs import CompileConfig

    trainer.Trainer.Config(compile=CompileConfig(enable=True))


@pytest.mark.parametrize("config_name, owner", [("llama3_debugmodel", "FlexAttention"),
                                                ("llama3_debugmodel_varlen_attn", "VarlenAttention")])
def test_upstream_attention_on_the_npu_stops_when_the_attention_patch_is_off(config_name, owner):
    """With attention off, upstream's flex (torch.compile on torch_npu's inductor) or varlen (CUDA flash) would run."""
    from torchtitan.models.llama3 import config_registry

    from npu_inject.patches import parallel_checks

    config = getattr(config_registry, config_name)()
    assert owner in parallel_checks.config_owners(config.model_spec)
    (problem,) = parallel_checks.unsupported_settings(config, "npu", {"attention": False})
    assert problem.startswith(f"{owner} (config") and "enable attention" in problem
    assert parallel_checks.unsupported_settings(config, "npu", {"attention": True}) == []
    assert parallel_checks.unsupported_settings(config, "cpu", {"attention": False}) == []  # CPU inductor lowers it


def test_a_cuda_moe_backend_stops_with_the_config_it_came_from():
    from torchtitan.models.qwen3 import config_registry

    from npu_inject.patches import parallel_checks

    config = config_registry.qwen3_moe_deepep()
    (problem,) = parallel_checks.unsupported_settings(config, "npu", {"attention": True})
    assert problem.startswith("moe_comm_backend='deepep'") and "moe_comm_backend='standard'" in problem
