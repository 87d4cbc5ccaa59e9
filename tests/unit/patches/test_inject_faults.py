"""inject_faults: a fault the job could never cause stops at start-up; the rank that injects a NaN says so.

The patch is applied by the runtime to torchtitan's own Trainer classes; the trainers built here stop in
the patch's check before torchtitan's ``__init__`` reads more of the stub config than ``comm`` and
``training``, or are subclasses with an ``__init__`` and ``train_step`` of their own.
"""

from __future__ import annotations

import types

import pytest
import torch

from npu_inject import runtime
from npu_inject.errors import RunStopped
from testkit import clean_env


def _activate(monkeypatch, faults, world_size=2, rank=0):
    for name, value in {"WORLD_SIZE": str(world_size), "RANK": str(rank)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    # inject_faults and the step's owner alone: the other patches' Trainer.__init__ wrappers would read more of the stub config
    runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="step_owner,inject_faults",
                               TORCHTITAN_NPU_FAULTS=faults))
    assert runtime.current().states["inject_faults"].state == "applied"


def _config(steps=10, comm_mode="default"):
    return types.SimpleNamespace(comm=types.SimpleNamespace(mode=comm_mode),
                                 training=types.SimpleNamespace(steps=steps))


def _one_layer_trainer(trainer_class):
    """A subclass with an ``__init__`` and ``train_step`` of its own (the patch reaches them), at step 2; made after
    the runtime is activated."""

    class OneLayer(trainer_class):
        def __init__(self, config):
            self.config = config
            self.step = 2
            self.model_parts = [torch.nn.Linear(2, 1)]

        def train_step(self, data_iterator):
            return self.model_parts[0](torch.ones(1, 2))

    return OneLayer


def _trainer_classes():
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer  # overrides __init__, no super()
    from torchtitan.trainer import Trainer

    return Trainer, FaultTolerantTrainer


@pytest.mark.parametrize("trainer", ["Trainer", "FaultTolerantTrainer"])
def test_a_fault_aimed_at_a_rank_the_job_lacks_stops_every_rank_naming_it(monkeypatch, trainer):
    """nan_loss@2:rank=5 in a 2-rank job was never caused, without a word; rank 0 stops as rank 5 would."""
    import torchtitan.trainer  # noqa: F401  (the patch's trigger)

    _activate(monkeypatch, "kill@3:rank=1,nan_loss@2:rank=5")
    cls = dict(zip(("Trainer", "FaultTolerantTrainer"), _trainer_classes()))[trainer]
    with pytest.raises(RunStopped) as stopped:
        cls(_config())
    assert str(stopped.value) == (
        "npu_inject inject_faults: TORCHTITAN_NPU_FAULTS: 'nan_loss@2:rank=5': the job has no rank 5 (its ranks "
        "are 0..1, WORLD_SIZE=2), so the fault would never be caused; aim it at a rank 0..1, or drop :rank= to "
        "cause it on every rank")


def test_a_dry_run_counts_the_ranks_it_stands_for(monkeypatch):
    """torchtitan's fake comm modes: one process standing for NGPU ranks (WORLD_SIZE unset or 1)."""
    import torchtitan.trainer  # noqa: F401

    _activate(monkeypatch, "hang@2:rank=4", world_size=1)
    monkeypatch.setenv("NGPU", "4")
    with pytest.raises(RunStopped, match=r"the job has no rank 4 \(its ranks are 0\.\.3, NGPU=4\)"):
        torchtitan.trainer.Trainer(_config(comm_mode="fake_backend"))


def test_a_fault_after_the_last_step_stops_naming_it_and_the_steps(monkeypatch):
    import torchtitan.trainer  # noqa: F401

    _activate(monkeypatch, "hang@11", world_size=1)
    with pytest.raises(RunStopped) as stopped:
        torchtitan.trainer.Trainer(_config(steps=10))
    assert str(stopped.value) == (
        "npu_inject inject_faults: TORCHTITAN_NPU_FAULTS: 'hang@11': step 11 is after the job's last step "
        "(--training.steps 10), so the fault would never be caused; use a step 1..10, or train longer")


def test_faults_the_job_can_cause_pass_and_the_rank_injecting_a_nan_says_so(monkeypatch, capsys):
    from torchtitan.trainer import Trainer

    _activate(monkeypatch, "nan_loss@2:rank=1,kill@10:rank=1", rank=1)
    trainer = _one_layer_trainer(Trainer)(_config(steps=10))
    assert torch.isnan(trainer.train_step(iter(()))).all()
    err = capsys.readouterr().err
    assert err.splitlines() == ["npu_inject inject_faults: step 2: nan_loss on rank 1"], err
    assert runtime.current().report.patches["inject_faults"].notes == ["step 2: nan_loss injected on rank 1"]


@pytest.mark.parametrize("kind", ["kill_in_forward", "hang_in_forward"])
def test_a_fault_in_the_forward_stops_the_rank_as_asked(monkeypatch, capsys, kind):
    """The forward's pre-hook stops the rank with the fault asked for: it read the kind late, after the step's
    loops had rebound it, and caused loss_spike's (a hang) for both (seen on the CANN emulation's torchft hang)."""
    from npu_inject.patches import inject_faults
    from torchtitan.trainer import Trainer

    stopped = []
    monkeypatch.setattr(inject_faults, "stop", lambda what, number: stopped.append((what, number)))
    _activate(monkeypatch, f"{kind}@2:rank=1", rank=1)
    _one_layer_trainer(Trainer)(_config(steps=10)).train_step(iter(()))
    assert stopped == [(kind, 2)]
