"""torchft_leave over stand-ins for torchtitan's torchft trainer's own train and train_step.

The run it is for, a hung rank in one replica group while the other trains on, is
``python tools/bench_failover.py --fault hang@4:rank=1`` (docs/fault-tolerance.md): the upstream loop calls
``train_step`` then, on step 1 only, ``set_pg_timeouts``; these stand-ins are that loop's two halves.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from npu_inject.patches import torchft_leave
from testkit import apply_with_step_owner


class Manager:
    def __init__(self):
        self.shutdowns = []

    def shutdown(self, wait: bool = True) -> None:
        self.shutdowns.append(wait)


@pytest.fixture
def trainer_class(monkeypatch):
    pytest.importorskip("torchft")
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.experiments.torchft import trainer as ft_trainer

    steps = []

    def train_step(trainer, data_iterator):
        trainer.step = trainer.healed_to or trainer.step  # a heal inside the step sets the peer's step
        steps.append(trainer.step)

    def train(trainer):
        trainer.step += 1
        trainer.train_step(iter(()))
        raise RuntimeError("Timed out waiting 15000ms for recv operation to complete")

    timeouts = []
    monkeypatch.setattr(ft_trainer.FaultTolerantTrainer, "train_step", train_step)
    monkeypatch.setattr(ft_trainer.FaultTolerantTrainer, "train", train)
    monkeypatch.setattr(dist_utils, "set_pg_timeouts", lambda timeout, parallel_dims: timeouts.append(timeout))
    ctx, restore = apply_with_step_owner(torchft_leave, device_kind="cpu")
    yield ft_trainer.FaultTolerantTrainer, ctx, timeouts
    restore()


def _trainer(cls, step: int = 0, healed_to: int = 0, enabled: bool = True):
    trainer = object.__new__(cls)
    trainer.step, trainer.healed_to = step, healed_to
    trainer.config = types.SimpleNamespace(comm=types.SimpleNamespace(train_timeout_seconds=15))
    trainer.parallel_dims = None
    trainer.ft_manager = types.SimpleNamespace(enabled=enabled, manager=Manager())
    return trainer


def test_a_failing_rank_shuts_its_torchft_manager_down_without_waiting_then_raises(trainer_class):
    cls, ctx, _ = trainer_class
    trainer = _trainer(cls)
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        trainer.train()
    assert trainer.ft_manager.manager.shutdowns == [False]
    assert ctx.notes[-1] == ("left torchft's quorum as training failed (RuntimeError: Timed out waiting 15000ms for "
                             "recv operation to complete)")


def test_without_fault_tolerance_nothing_is_shut_down(trainer_class):
    cls, ctx, _ = trainer_class
    trainer = _trainer(cls, enabled=False)
    with pytest.raises(RuntimeError):
        trainer.train()
    assert trainer.ft_manager.manager.shutdowns == [] and ctx.notes == []  # no watchdog either


def test_a_group_healed_past_step_1_gets_the_train_timeout_after_its_first_step_once(trainer_class):
    cls, ctx, timeouts = trainer_class
    trainer = _trainer(cls, step=1, healed_to=7)
    trainer.train_step(iter(()))
    trainer.train_step(iter(()))
    assert [timeout.total_seconds() for timeout in timeouts] == [15]
    assert any("after this process's first step, step 7" in note for note in ctx.notes)


def test_a_first_step_numbered_1_is_left_to_upstream(trainer_class):
    cls, _, timeouts = trainer_class
    trainer = _trainer(cls, step=1)
    trainer.train_step(iter(()))
    assert timeouts == []


# The watchdog ends the process: run in a child. Stand-ins as above; step 1 arms it (1 s), then step 2 either
# spends 3 s in torchft's quorum wait (not counted) or 3 s in the step itself (the process ends).
WATCHDOG = textwrap.dedent("""
    import sys, time, types
    from npu_inject import module_facts
    from npu_inject.patching import PatchContext
    from npu_inject.patches import step_owner, torchft_leave
    from torchft.manager import Manager
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    def train_step(trainer, data_iterator):
        if trainer.step == 2:
            Manager.wait_quorum(None)
            time.sleep(float(sys.argv[1]))

    FaultTolerantTrainer.train_step = train_step
    Manager.wait_quorum = lambda manager: time.sleep(3)
    for module in (step_owner, torchft_leave):
        module.apply(PatchContext(patch_id=module.__name__.rsplit(".", 1)[1], device_kind="cpu", options={},
                                  declared_targets=module_facts.declared_names(module)))
    trainer = object.__new__(FaultTolerantTrainer)
    trainer.config = types.SimpleNamespace(comm=types.SimpleNamespace(train_timeout_seconds=1))
    trainer.ft_manager = types.SimpleNamespace(enabled=True, manager=None)
    for trainer.step in (1, 2):
        trainer.train_step(iter(()))
    print("trained on", flush=True)
""")


@pytest.mark.parametrize("sleep_in_step, ends", [(0, False), (3, True)])
def test_a_step_longer_than_the_train_timeout_outside_torchfts_waits_ends_the_process(sleep_in_step, ends):
    pytest.importorskip("torchft")
    result = subprocess.run([sys.executable, "-c", WATCHDOG, str(sleep_in_step)], capture_output=True, text=True,
                            timeout=120)
    if ends:
        assert result.returncode == 1 and "trained on" not in result.stdout
        assert "Timeout (0:00:01)!" in result.stderr and "in train_step" in result.stderr, result.stderr[-2000:]
    else:  # 3 s in torchft's quorum wait: not counted
        assert result.returncode == 0 and "trained on" in result.stdout, result.stderr[-2000:]
