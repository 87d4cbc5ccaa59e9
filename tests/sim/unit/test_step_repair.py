"""Patch step_repair on the simulated NPU: apply and revert, what it leaves to uce_repair, what it says at start-up.

Its repairs across ranks (the store's agreement, stop, restart, communicators made anew, the step retried on
every rank) run on the real torch_npu over the CANN emulation: tests/cann_emu/test_step_repair.py; its
agreement alone on torch's HashStore: tests/unit/runtime/test_repair_channel.py.
"""

from __future__ import annotations

import os

import pytest

from test_uce_repair import _trainer, recovery  # noqa: F401  (the fixture, and a bare trainer)
def test_with_several_ranks_and_step_repair_on_a_uce_is_left_to_step_repair(recovery, monkeypatch, npu_patch):
    """step_repair (on by default) repairs a UCE on every rank together; uce_repair steps aside. Without a
    process group (this bare trainer's) step_repair has no store to agree through: it says so, and the failure
    passes through unrepaired."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("HCCL_ASYNC_ERROR_HANDLING", raising=False)
    import importlib

    from npu_inject import runtime as runtimes
    from npu_inject.training_step import OWNER

    runtime = runtimes.activate({"TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_PATCHES": "step_owner,uce_repair,step_repair"},
                                install_hooks=False)
    importlib.import_module("torchtitan.trainer")
    for each in ("step_owner", "uce_repair", "step_repair"):
        assert runtime.apply(each), runtime.report.patches[each].reason

    assert OWNER.phase_order()["on_failure"] == ["step_repair", "uce_repair"]
    assert "TORCH_HCCL_ASYNC_ERROR_HANDLING" not in os.environ  # the watchdog's teardown is the user's to give up
    with pytest.raises(RuntimeError, match="UCE ERROR"):
        _trainer(["UCE ERROR, "]).train_step(iter([({}, 1), ({}, 2)]))
    assert recovery.restarted == []
    assert runtime.report.patches["step_repair"].fallbacks == [
        "WORLD_SIZE 2 without a default process group: no store to agree through; device faults are not repaired"]


@pytest.mark.parametrize("value, says", [(None, "is unset (1, tear down): torch_npu's watchdog ends the process"),
                                         ("1", "is 1: torch_npu's watchdog ends the process"), ("0", None)])
def test_step_repair_says_when_the_watchdog_would_end_the_process_first(monkeypatch, npu_patch, value, says):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("HCCL_ASYNC_ERROR_HANDLING", raising=False)
    if value is None:
        monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", value)
    notes = npu_patch("step_repair").report.patches["step_repair"].notes
    said = [note for note in notes if "watchdog" in note]
    assert (said == []) if says is None else (says in said[0]), notes


def test_revert_restores_train_step(monkeypatch, npu_patch):
    from torchtitan.trainer import Trainer

    from npu_inject.training_step import OWNER

    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    runtime = npu_patch("step_repair")
    original = Trainer.train_step
    assert OWNER.phase_order()["on_failure"] == ["step_repair"]
    runtime.revert("step_repair")  # its handlers leave the step's owner, which stays
    assert OWNER.participants == [] and Trainer.train_step is original


@pytest.mark.parametrize("dump, kept, says", [
    (None, "0", "TORCH_HCCL_DUMP_ON_TIMEOUT=0 (torch_npu's flight recorder still records"),
    ("1", "1", "with TORCH_HCCL_DUMP_ON_TIMEOUT=1: a failed collective that torch_npu's watchdog meets first stalls"),
    ("0", "0", None)])
def test_with_teardown_off_the_failure_dump_is_kept_off_or_said(monkeypatch, npu_patch, dump, kept, says):
    """With TORCH_HCCL_ASYNC_ERROR_HANDLING=0, torch_npu's watchdog would sleep TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC
    holding its work list after signalling a dump (torch_npu 2.14's source; the emulation's PP failed send): unset,
    the dump is kept off before any process group is made, and the revert gives the variable back."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", "0")
    if dump is None:
        monkeypatch.delenv("TORCH_HCCL_DUMP_ON_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("TORCH_HCCL_DUMP_ON_TIMEOUT", dump)
    runtime = npu_patch("step_repair")
    assert os.environ.get("TORCH_HCCL_DUMP_ON_TIMEOUT") == kept
    fallbacks = runtime.report.patches["step_repair"].fallbacks
    assert (fallbacks == []) if says is None else (says in fallbacks[0]), fallbacks
    runtime.revert("step_repair")
    assert os.environ.get("TORCH_HCCL_DUMP_ON_TIMEOUT") == dump
