"""The training step's one owner (npu_inject/training_step.py): its declared order, its phases, retry and discard.

The owner's behaviour is checked on a stand-in trainer whose step takes batches, clips and steps an optimizer
through the same calls torchtitan's does; the order is checked on the patches as the runtime applies them.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

from npu_inject import registry, runtime
from npu_inject.training_step import DISCARD, ORDER, PHASES, RETRY, StepOwner
from testkit import clean_env

STEP_PATCHES_OFF_BY_DEFAULT = ("inject_faults",)


def _takes_part(patch_id: str) -> bool:
    module = importlib.import_module(f"npu_inject.patches.{patch_id}")
    return "take_part(" in inspect.getsource(module)


def test_every_patch_that_takes_part_is_in_the_declared_order_and_requires_the_owner():
    patches = registry.load(None, entry_points=False).patches
    taking_part = {patch_id for patch_id in patches if patch_id != "step_owner" and _takes_part(patch_id)}
    assert taking_part == set(ORDER) & set(patches)
    for patch_id in taking_part:
        assert "step_owner" in patches[patch_id].requires, patch_id
    assert len(set(ORDER)) == len(ORDER)


def test_the_runtime_applies_the_step_patches_in_the_declared_order(monkeypatch):
    """The order a CPU run gets (the NPU-only and torchft patches aside): before-phases outermost first,
    after- and failure-phases innermost first, whatever order the patches applied in."""
    from npu_inject.training_step import OWNER

    monkeypatch.setenv("TORCHTITAN_NPU_FAULTS", "kill@99")
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults",
                                    TORCHTITAN_NPU_FAULTS="kill@99"), install_hooks=False)
    try:
        importlib.import_module("torchtitan.trainer")
        for patch_id in ("step_owner", "finite_steps", "inject_faults", "restart_progress"):
            assert rt.apply(patch_id), rt.report.patches[patch_id].reason
        assert OWNER.phase_order() == {
            "before_step": ["restart_progress", "inject_faults", "finite_steps"],
            "before_optimizer": ["finite_steps"],
            "after_step": ["finite_steps", "inject_faults", "restart_progress"],
            "on_failure": ["finite_steps"],
        }
    finally:
        runtime.deactivate()
    assert OWNER.participants == []


def test_a_patch_outside_the_order_or_an_unknown_phase_is_refused_naming_the_file():
    owner = StepOwner()
    with pytest.raises(ValueError, match=r"'mine' takes part in the training step but is not in ORDER of .*training_step.py"):
        owner.take_part("mine", {"before_step": print})
    with pytest.raises(ValueError, match=r"unknown step phase\(s\) after_update; the phases are before_step"):
        owner.take_part("finite_steps", {"after_update": print})
    assert PHASES == ("before_step", "before_optimizer", "after_step", "on_failure")


class _Trainer:
    """torchtitan's step in miniature: two batches, a backward, the clip, the optimizer and the scheduler."""

    def __init__(self, owner: StepOwner, failures=()):
        import torch

        self.owner, self.failures, self.seen, self.step = owner, list(failures), [], 1
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.optimizers = torch.optim.SGD([self.weight], lr=0.5)
        self.lr_schedulers = types.SimpleNamespace(steps=0)
        self.lr_schedulers.step = lambda: setattr(self.lr_schedulers, "steps", self.lr_schedulers.steps + 1)

    def raw_step(self, data_iterator):
        import torch

        batches = [next(data_iterator), next(data_iterator)]
        self.seen.append([labels for _, labels in batches])
        self.optimizers.zero_grad()
        (self.weight * torch.tensor([float(label) for _, label in batches])).sum().backward()
        if self.failures:
            raise RuntimeError(self.failures.pop(0))
        self.owner.clipped(torch.linalg.vector_norm(self.weight.grad))
        self.optimizers.step()
        self.lr_schedulers.step()
        return "trained"

    def train_step(self, data_iterator):
        return self.owner.train_step(_Trainer.raw_step, self, data_iterator)


def _batches():
    return iter([({"input": "a"}, 1), ({"input": "b"}, 2), ({"input": "c"}, 3), ({"input": "d"}, 4)])


def test_phases_run_in_order_and_a_skipped_update_leaves_weights_and_schedule_alone():
    owner, calls = StepOwner(), []
    owner.take_part("finite_steps", {
        "before_step": lambda step: calls.append(("finite_steps", "before_step")),
        "before_optimizer": lambda step: step.skip_update(f"norm {step.grad_norm_value():.3f}"),
        "after_step": lambda step: calls.append(("finite_steps", "after_step", step.skipped)),
    })
    owner.take_part("restart_progress", {
        "before_step": lambda step: calls.append(("restart_progress", "before_step")),
        "after_step": lambda step: calls.append(("restart_progress", "after_step")),
    })
    trainer = _Trainer(owner)
    assert trainer.train_step(_batches()) == "trained"
    assert calls == [("restart_progress", "before_step"), ("finite_steps", "before_step"),
                     ("finite_steps", "after_step", ["norm 2.236"]), ("restart_progress", "after_step")]
    assert trainer.weight.tolist() == [1.0, 1.0] and trainer.lr_schedulers.steps == 0
    assert "step" not in vars(trainer.optimizers)  # the shadowing is gone with the step
    owner.participants.clear()
    trainer.train_step(_batches())
    assert trainer.weight.tolist() == [0.5, 0.0] and trainer.lr_schedulers.steps == 1


def test_a_retry_gets_the_same_batches_after_the_failed_attempts_frames_are_gone():
    owner, recovered = StepOwner(), []

    def on_failure(step, error):
        if "repairable" not in str(error):
            return None

        def recover():
            recovered.append((step.attempt, error.__traceback__ is not None))
            return RETRY

        return recover

    owner.take_part("uce_repair", {"on_failure": on_failure})
    trainer, source = _Trainer(owner, failures=["repairable"]), _batches()
    assert trainer.train_step(source) == "trained"
    assert trainer.seen == [[1, 2], [1, 2]] and recovered == [(0, True)]
    assert next(source) == ({"input": "c"}, 3)  # the retry took nothing more from the data
    assert trainer.weight.tolist() == [0.5, 0.0]  # one update, the retried attempt's


def test_a_discarded_step_returns_none_and_an_unanswered_error_is_raised_as_it_was():
    owner, exits = StepOwner(), []
    owner.take_part("torchft_recover", {
        "before_step": lambda step: step.on_exit(lambda: exits.append(step.number)),
        "on_failure": lambda step, error: (lambda: DISCARD) if "collective" in str(error) else None,
    })
    trainer = _Trainer(owner, failures=["collective failed"])
    assert trainer.train_step(_batches()) is None and trainer.weight.tolist() == [1.0, 1.0]
    trainer = _Trainer(owner, failures=["something else"])
    with pytest.raises(RuntimeError, match="something else") as raised:
        trainer.train_step(_batches())
    assert raised.traceback[-1].name == "raw_step"  # the error as the step raised it
    assert exits == [1, 1] and owner.current is None


def test_a_recovery_answering_neither_retry_nor_discard_is_a_type_error_naming_the_file():
    owner = StepOwner()
    owner.take_part("uce_repair", {"on_failure": lambda step, error: lambda: "again"})
    with pytest.raises(TypeError, match=r"returned 'again'; valid: RETRY or DISCARD \(npu_inject/training_step.py\)"):
        _Trainer(owner, failures=["x"]).train_step(_batches())


def test_an_override_calling_the_base_step_is_one_step():
    owner, steps = StepOwner(), []
    owner.take_part("restart_progress", {"before_step": lambda step: steps.append(step.number)})
    trainer = _Trainer(owner)

    def override(self, data_iterator):  # FaultTolerantTrainer.train_step calling super().train_step()
        return owner.train_step(_Trainer.raw_step, self, data_iterator)

    assert owner.train_step(override, trainer, _batches()) == "trained"
    assert steps == [1]


def test_the_update_began_flag_follows_the_optimizers_pre_hook_in_the_step_only():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    owner, seen = StepOwner(), []
    hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: owner.optimizer_began())
    try:
        owner.take_part("torchft_recover", {"after_step": lambda step: seen.append(step.update_began)})
        trainer = _Trainer(owner)
        trainer.optimizers.step()  # outside a step: no step of the owner's
        trainer.train_step(_batches())
    finally:
        hook.remove()
    assert seen == [True]


def test_a_value_read_along_is_made_on_every_attempt_before_the_handlers_and_read_in_the_norms_one_copy(monkeypatch):
    import torch

    owner, made, seen = StepOwner(), [], []

    def before_step(step):
        step.read_along("twice_the_weight_sum", lambda: made.append(step.attempt) or 2 * step.trainer.weight.sum())

    def before_optimizer(step):
        seen.append((list(made), step.grad_norm_value(), step.value_read("twice_the_weight_sum")))

    owner.take_part("spikes", {"before_step": before_step, "before_optimizer": before_optimizer})
    owner.take_part("uce_repair", {"on_failure": lambda step, error: lambda: RETRY})
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or tolist(self))
    trainer = _Trainer(owner, failures=["once"])
    trainer.train_step(_batches())
    # the failed attempt never clipped: one make, for the retried attempt (1), before the handler read both
    assert seen == [([1], pytest.approx(5 ** 0.5), 4.0)]
    assert reads == [torch.Size([2])]  # the norm and the value in one host copy
    with pytest.raises(KeyError, match=r"no value 'loss' was made for this attempt \(registered: twice_the_weight_sum\)"):
        owner.current = None
        from npu_inject.training_step import Step
        Step(trainer, None, 1, _reads_along={"twice_the_weight_sum": None}).value_read("loss")
