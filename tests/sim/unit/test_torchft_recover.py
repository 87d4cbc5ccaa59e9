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

    rt = runtime.activate({"TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_PATCHES": "torchft_npu,torchft_recover"},
                          install_hooks=False)
    try:
        catalog = registry.load(None, entry_points=False)
        for patch_id in ("torchft_npu", "torchft_recover"):
            for trigger in catalog.patches[patch_id].triggers:
                importlib.import_module(trigger)
        from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

        original = FaultTolerantTrainer.__dict__["train_step"]
        for patch_id in ("torchft_npu", "torchft_recover"):
            assert rt.apply(patch_id), rt.report.patches[patch_id].reason
        assert FaultTolerantTrainer.__dict__["train_step"] is not original
        rt.revert_all()
        assert FaultTolerantTrainer.__dict__["train_step"] is original
    finally:
        runtime.deactivate()
