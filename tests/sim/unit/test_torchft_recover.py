"""Patch torchft_recover on the simulated NPU: apply and revert, with torchft_npu, which it requires.

What it does is checked over stand-ins in tests/unit/patches/test_torchft_recover.py; the recovery itself (a
replica group hung inside its step, the survivor's device stopped, restarted and its step discarded) runs on
the real torch_npu over the CANN emulation: tests/cann_emu/test_torchft_failover.py (-m cann_emu_long).
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("torchft")


def test_apply_then_revert_restores_the_torchft_trainer():
    from npu_inject import registry, runtime

    from npu_inject.training_step import OWNER

    patch_ids = ("step_owner", "torchft_npu", "torchft_recover")
    rt = runtime.activate({"TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_PATCHES": ",".join(patch_ids)}, install_hooks=False)
    try:
        catalog = registry.load(None, entry_points=False)
        for patch_id in patch_ids:
            for trigger in catalog.patches[patch_id].triggers:
                importlib.import_module(trigger)
        from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

        original = FaultTolerantTrainer.__dict__["train_step"]
        for patch_id in patch_ids:
            assert rt.apply(patch_id), rt.report.patches[patch_id].reason
        assert FaultTolerantTrainer.__dict__["train_step"] is not original
        assert OWNER.phase_order()["on_failure"] == ["torchft_recover"]
        rt.revert_all()
        assert OWNER.participants == []
        assert FaultTolerantTrainer.__dict__["train_step"] is original
    finally:
        runtime.deactivate()
