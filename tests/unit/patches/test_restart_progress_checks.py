"""restart_progress over a stand-in for torchtitan's torchft trainer and the launcher's store.

The runs it is for: tests/e2e/test_restart_progress.py (no torchft) and tests/e2e/test_torchft.py (a torchft
group killed under each of upstream's modes). Here one restarted attempt's steps, and the heal torchft signals
by loading a peer's torchft state (``Manager.load_state_dict``), whatever torchtitan's step counter does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from npu_inject.errors import RunStopped
from npu_inject.patches import restart_progress
from testkit import apply_with_step_owner


class Store:
    def __init__(self, **keys: str):
        self.keys = dict(keys)

    def check(self, names):
        return all(name in self.keys for name in names)

    def get(self, name):
        return self.keys[name].encode()

    def set(self, name, value):
        self.keys[name] = value


@pytest.fixture
def restarted(monkeypatch):
    """(the FaultTolerantTrainer class, torchft's Manager class, the store) in restart attempt 1, whose earlier
    attempt reached step 7; the stand-in step heals when the trainer's ``heal_in_step`` says so."""
    pytest.importorskip("torchft")
    from torchft.manager import Manager
    from torchtitan.experiments.torchft import trainer as ft_trainer

    def train_step(trainer, data_iterator):
        if trainer.step % trainer.commit_every == 0:  # a quorum, its heal if any, then the commit point
            if trainer.heal_in_step == trainer.step:
                trainer.ft_manager.manager.load_state_dict({"step": 2, "batches_committed": 4})  # torchft's heal
            trainer.ft_manager.manager.should_commit()

    monkeypatch.setattr(ft_trainer.FaultTolerantTrainer, "train_step", train_step)
    monkeypatch.setattr(Manager, "should_commit", lambda manager, timeout=None: True)  # the vote, without peers
    store = Store(**{restart_progress.STEP_KEY: "7"})
    monkeypatch.setattr(restart_progress, "launcher_store", lambda: store)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("RANK", "0")
    ctx, restore = apply_with_step_owner(restart_progress, device_kind="cpu")
    yield ft_trainer.FaultTolerantTrainer, Manager, store, ctx
    restore()


def _trainer(cls, manager_cls, heal_in_step: int, semi_sync: str | None = "diloco", commit_every: int = 5):
    """DiLoCo as upstream configures it by default: 10 steps between synchronisations, 2 fragments (a commit
    point every 5 steps)."""
    trainer = object.__new__(cls)
    manager = object.__new__(manager_cls)
    trainer.step, trainer.heal_in_step, trainer.commit_every = 0, heal_in_step, commit_every
    trainer.ft_manager = SimpleNamespace(enabled=True, manager=manager)
    trainer.config = SimpleNamespace(fault_tolerance=SimpleNamespace(semi_sync_method=semi_sync, sync_steps=10))
    return trainer


def _train(trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.step += 1  # torchtitan's loop counts, then calls train_step
        trainer.train_step(iter(()))


def test_a_heal_that_leaves_torchtitans_step_alone_is_still_a_heal(restarted):
    """DiLoCo: the group heals at its synchronisation in step 5, torchtitan's step goes on from 5."""
    cls, manager_cls, store, ctx = restarted
    trainer = _trainer(cls, manager_cls, heal_in_step=5)
    _train(trainer, 12)  # past the earlier attempt's step 7: no stop
    assert store.keys[restart_progress.STEP_KEY] == "12"
    assert ctx.notes == ["restart attempt 1 healed from a torchft peer in its step 5 (torchtitan's step now 5) "
                         "after training from the initial weights (an earlier attempt reached step 7)"]


def test_a_group_whose_first_synchronisation_comes_after_the_earlier_step_heals_there(restarted):
    """Killed at step 8 (the earlier attempt reached 7); the group's first quorum with a peer is at step 10."""
    cls, manager_cls, _, ctx = restarted
    trainer = _trainer(cls, manager_cls, heal_in_step=10, commit_every=10)
    _train(trainer, 14)
    assert ctx.notes[0].startswith("restart attempt 1 healed from a torchft peer in its step 10")


@pytest.mark.parametrize("semi_sync, commit_every, stops_at", [
    ("diloco", 5, 10),   # the first commit point at or after step 7
    (None, 1, 7),        # a synchronous job commits every step
    ("local_sgd", 100, 17),  # no commit point within sync_steps past step 7
])
def test_a_group_that_never_heals_stops_at_its_first_commit_point_past_the_earlier_step(
        restarted, semi_sync, commit_every, stops_at):
    cls, manager_cls, _, _ = restarted
    trainer = _trainer(cls, manager_cls, heal_in_step=0, semi_sync=semi_sync, commit_every=commit_every)
    with pytest.raises(RunStopped) as stopped:
        _train(trainer, 30)
    assert trainer.step == stops_at
    line = str(stopped.value)
    assert line.startswith("npu_inject restart_progress: restart attempt 1 of this worker group trained from step "
                           f"1 to step {stops_at} again without healing from a torchft peer")
    assert (f"under {semi_sync} a group meets its peers only at its synchronisations" in line) == bool(semi_sync)


def test_the_manager_is_restored_when_the_patch_is(restarted):
    cls, manager_cls, _, ctx = restarted
    original = vars(manager_cls)["load_state_dict"]
    _train(_trainer(cls, manager_cls, heal_in_step=2), 3)  # the first step wrapped it
    assert vars(manager_cls)["load_state_dict"] is not original
    ctx.restore()
    assert vars(manager_cls)["load_state_dict"] is original
