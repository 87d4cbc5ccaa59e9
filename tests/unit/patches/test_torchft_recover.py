"""torchft_recover over stand-ins: torch_npu's recovery calls, torchft's manager, torchtitan's torchft trainer.

The run it is for, a replica group hung inside its step while the other trains on, is
``CANN_EMU_ASYNC_STREAMS=1 python tools/bench_failover.py --target cann --fault hang_in_forward@4:rank=1``
(docs/fault-tolerance.md) on the real torch_npu; here the order of the recovery and what it refuses.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from npu_inject.errors import RunStopped
from npu_inject.patches import torchft_recover
from testkit import apply_with_step_owner

FORCE_STOP = "npuSynchronizeDevice: NPU function error: FORCE STOP, error code is 107022"


class Group:
    def __init__(self, calls):
        self.calls, self.stopped_device, self.issued = calls, None, 0

    def abort(self):  # torchft_npu's: stops the device first
        self.calls.append(("abort",))
        self.stopped_device = 0


class Manager:
    def __init__(self, calls, votes=False):
        self.calls, self.votes, self._pg = calls, votes, Group(calls)

    def report_error(self, error):
        self.calls.append(("report_error", str(error)))

    def should_commit(self):
        self.calls.append(("should_commit",))
        return self.votes


@pytest.fixture
def recover(monkeypatch):
    pytest.importorskip("torchft")
    from torchtitan.experiments.torchft import trainer as ft_trainer

    calls = []
    npu = types.SimpleNamespace(restart_device=lambda device: calls.append(("restart_device", device)))
    distributed = types.ModuleType("torch_npu.distributed")
    distributed.reinit_process_group = lambda rebuild_link: calls.append(("reinit_process_group", rebuild_link))
    fake = types.ModuleType("torch_npu")
    fake.npu, fake.distributed = npu, distributed
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setitem(sys.modules, "torch_npu.distributed", distributed)

    def train_step(trainer, data_iterator):
        calls.append(("train_step", trainer.step))
        trainer.ft_manager.manager._pg.issued += trainer.collectives
        if trainer.optimizer is not None:
            trainer.optimizer.step()
        if trainer.fails_with:
            raise RuntimeError(trainer.fails_with)

    monkeypatch.setattr(ft_trainer.FaultTolerantTrainer, "train_step", train_step)
    ctx, restore = apply_with_step_owner(torchft_recover, device_kind="npu")
    yield ft_trainer.FaultTolerantTrainer, ctx, calls
    restore()


def _trainer(cls, calls, fails_with=FORCE_STOP, stopped=0, votes=False, optimizer=None, collectives=3):
    trainer = object.__new__(cls)
    trainer.step, trainer.fails_with, trainer.optimizer, trainer.collectives = 4, fails_with, optimizer, collectives
    trainer.model_parts = [torch.nn.Linear(2, 2)]
    trainer.lr_schedulers = types.SimpleNamespace(step=lambda: calls.append(("lr_step",)))
    manager = Manager(calls, votes)
    manager._pg.stopped_device = stopped
    trainer.ft_manager = types.SimpleNamespace(enabled=True, manager=manager)
    return trainer


def test_a_step_whose_device_torchft_stopped_is_restarted_resumed_and_voted_down(recover):
    cls, ctx, calls = recover
    trainer = _trainer(cls, calls, stopped=1)
    assert trainer.train_step(iter(())) is None
    assert [call[0] for call in calls] == ["train_step", "restart_device", "reinit_process_group", "report_error",
                                           "should_commit", "lr_step"]
    assert calls[1] == ("restart_device", 1) and calls[2] == ("reinit_process_group", False)
    assert trainer.ft_manager.manager._pg.stopped_device is None  # the next stop is a new one
    assert any("step 4 discarded" in note for note in ctx.notes)


def test_a_torchft_collective_that_failed_by_itself_is_aborted_then_recovered_alike(recover):
    # the peer's process ended (or its own timer destroyed its communicator) before this rank's timer fired
    cls, ctx, calls = recover
    failed = "AclrtMemcpyWithModeSwitch error code is 13 cann_emu: aclrtSynchronizeDevice: HcclAllReduce, queued failed"
    trainer = _trainer(cls, calls, fails_with=failed, stopped=None)
    assert trainer.train_step(iter(())) is None
    assert [call[0] for call in calls] == ["train_step", "abort", "restart_device", "reinit_process_group",
                                           "report_error", "should_commit", "lr_step"]
    assert any("collective failed" in note for note in ctx.notes)


def test_errors_this_patch_did_not_cause_go_on_as_they_were(recover):
    cls, _, calls = recover
    with pytest.raises(RuntimeError, match="Inner error"):  # not a stop
        _trainer(cls, calls, fails_with="The Inner error is reported as above", stopped=0).train_step(iter(()))
    with pytest.raises(RuntimeError, match="FORCE STOP"):  # a stop torchft's group did not make
        _trainer(cls, calls, stopped=None).train_step(iter(()))
    with pytest.raises(RuntimeError, match="HcclAllReduce"):  # an HCCL failure in a step without torchft's group
        _trainer(cls, calls, fails_with="HcclAllReduce failed", stopped=None, collectives=0).train_step(iter(()))
    with pytest.raises(RuntimeError, match="UCE ERROR"):  # uce_repair's
        _trainer(cls, calls, fails_with="UCE ERROR HcclAllReduce", stopped=None).train_step(iter(()))
    assert [call[0] for call in calls] == ["train_step"] * 4


def test_a_stop_after_the_update_began_or_a_commit_vote_stops_the_job(recover):
    cls, _, calls = recover
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RunStopped, match="after the step's optimizer update began"):
        _trainer(cls, calls, optimizer=optimizer).train_step(iter(()))
    assert "restart_device" not in [call[0] for call in calls]
    with pytest.raises(RunStopped, match="voted to commit a step whose device work was dropped"):
        _trainer(cls, calls, votes=True).train_step(iter(()))
