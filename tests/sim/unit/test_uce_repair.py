"""Patch uce_repair on the simulated NPU: apply and revert, and what it does with each kind of UCE.

torch_npu's own UCE path (the task queue's "UCE ERROR", aclrtGetMemUceInfo, check_uce_in_memory,
restart_device) runs on the CANN emulation: tests/cann_emu/test_uce.py. Here torch_npu's two recovery calls
are stood in for, to check the patch's decisions and that the retried step sees the same batches.
"""

from __future__ import annotations

import types

import pytest

from npu_inject.errors import RunStopped


@pytest.fixture
def applied(npu_patch):
    return npu_patch("uce_repair")


@pytest.fixture
def recovery(monkeypatch):
    """torch_npu.npu's check_uce_in_memory (answering ``where``) and restart_device, recorded."""
    import torch_npu

    calls = types.SimpleNamespace(where=2, restarted=[])
    monkeypatch.setattr(torch_npu.npu, "check_uce_in_memory", lambda device: calls.where, raising=False)
    monkeypatch.setattr(torch_npu.npu, "restart_device", calls.restarted.append, raising=False)
    return calls


def _trainer(failures: list[str], before_failing=lambda: None, model_parts=()):
    """A Trainer whose train_step takes two batches and raises each of ``failures`` once, in turn, after calling
    ``before_failing`` (a subclass made after the patch applied: wrap_overrides wraps it as it is created)."""
    import torch
    from torchtitan.trainer import Trainer

    class Stepping(Trainer):
        def __init__(self) -> None:  # none of Trainer's building
            self.step, self.device, self.seen, self.model_parts = 3, torch.device("npu", 0), [], list(model_parts)

        def train_step(self, data_iterator):
            batches = [next(data_iterator), next(data_iterator)]
            batches[0][0]["input"] = "moved to the device"  # torchtitan moves tensors in the dict it was given
            self.seen.append([(dict(inputs), labels) for inputs, labels in batches])
            if failures:
                before_failing()
                raise RuntimeError(failures.pop(0))
            return "trained"

    return Stepping()


def test_a_uce_in_temporary_memory_is_repaired_and_the_step_trained_again_on_the_same_batches(applied, recovery):
    trainer = _trainer(["UCE ERROR, "])
    source = iter([({"input": "a"}, 1), ({"input": "b"}, 2), ({"input": "c"}, 3)])
    assert trainer.train_step(source) == "trained"
    assert recovery.restarted == [0]
    first, retried = trainer.seen
    assert [labels for _, labels in retried] == [1, 2] and retried[1] == ({"input": "b"}, 2)
    assert retried[0][0] == {"input": "moved to the device"} and first == retried
    assert next(source) == ({"input": "c"}, 3)  # the retry took nothing more from the data
    assert any("repaired" in note for note in applied.report.patches["uce_repair"].notes)


@pytest.mark.parametrize("where, failures, says", [
    (3, ["UCE ERROR, "], "memory holding the job's state"),
    (1, ["UCE ERROR, "], "outside torch_npu's pool"),
    (2, ["UCE ERROR, ", "UCE ERROR, "], "a second device memory error"),
])
def test_a_uce_it_cannot_repair_stops_in_one_line(applied, recovery, where, failures, says):
    recovery.where = where
    with pytest.raises(RunStopped, match=says):
        _trainer(failures).train_step(iter([({}, 1), ({}, 2)]))


def test_a_uce_after_the_optimizer_began_stops_without_a_retry(applied, recovery):
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.step()  # an earlier step's update: the wrapper starts each step afresh
    with pytest.raises(RunStopped, match="reported after the step's optimizer began"):
        _trainer(["UCE ERROR, "], before_failing=optimizer.step).train_step(iter([({}, 1), ({}, 2)]))
    assert recovery.restarted == []


def test_fsdp_is_reset_to_before_the_step_after_the_repair_and_before_the_retry(recovery, monkeypatch, npu_patch):
    """The failed attempt may leave FSDP parameter groups unsharded (their parameters then the freed all-gather
    buffers): FSDPModule.reset_iter_state on each model part's root FSDP module, once restart_device ran."""
    import torch
    import torch.distributed.fsdp

    class Root(torch.nn.Module):  # stands for FSDPModule (fully_shard's classes need a process group)
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def reset_iter_state(self) -> None:
            recovery.restarted.append("reset")

        def _get_fsdp_state(self):  # no parameter groups: no gradients held unreduced to drop
            return types.SimpleNamespace(_fsdp_param_groups=[])

    class Inner(Root):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

    monkeypatch.setattr(torch.distributed.fsdp, "FSDPModule", Root)
    npu_patch("uce_repair")
    trainer = _trainer(["UCE ERROR, "], model_parts=[torch.nn.Sequential(Root()), torch.nn.Linear(1, 1)])
    assert trainer.train_step(iter([({}, 1), ({}, 2)])) == "trained"
    assert recovery.restarted == [0, "reset"]  # the outermost FSDP module of the first part; none in the second


def test_with_several_ranks_a_repairable_uce_stops(recovery, monkeypatch, npu_patch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # read when the patch applies
    npu_patch("uce_repair")
    with pytest.raises(RunStopped, match="retrying the step needs every rank to stop and retry together"):
        _trainer(["UCE ERROR, "]).train_step(iter([({}, 1), ({}, 2)]))
    assert recovery.restarted == []


def test_other_errors_pass_through(applied, recovery):
    with pytest.raises(RuntimeError, match="something else"):
        _trainer(["something else"]).train_step(iter([({}, 1), ({}, 2)]))
    assert recovery.restarted == []


def test_revert_restores_train_step(applied):
    from torchtitan.trainer import Trainer

    from npu_inject.training_step import OWNER

    original = Trainer.train_step
    assert OWNER.phase_order()["on_failure"] == ["uce_repair"]
    applied.revert("uce_repair")  # its handlers leave the step's owner, which stays
    assert OWNER.participants == [] and Trainer.train_step is original
    applied.revert("step_owner")
    assert Trainer.train_step is not original

