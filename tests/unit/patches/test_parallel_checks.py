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
