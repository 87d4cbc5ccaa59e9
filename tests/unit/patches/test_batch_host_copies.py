"""batch_host_copies: the loader's host tensors answer later host reads of their device copies.

Driven through upstream's own ``Trainer.batch_generator`` (a stand-in trainer with its metrics fields) and
the assignment ``Trainer.train_step`` makes, with a CPU tensor that claims a device as the device copy; the
copies host_reads would make are counted.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from host_reads_kit import DeviceTensor, applied_on_npu, count_copies
from npu_inject.ops import host_reads
from npu_inject.patches import batch_host_copies


@pytest.fixture
def copies(monkeypatch) -> list:
    return count_copies(monkeypatch)


@pytest.fixture
def trainer_class(copies):
    from torchtitan.trainer import Trainer

    with applied_on_npu(batch_host_copies, Trainer, "batch_generator"):
        yield Trainer


def _batches(trainer_class, *batches):
    trainer = types.SimpleNamespace(metrics_processor=types.SimpleNamespace(ntokens_since_last_log=0,
                                                                            data_loading_times=[]))
    return trainer, trainer_class.batch_generator(trainer, iter(batches))


def _to_device(input_dict: dict) -> None:
    """What ``Trainer.train_step`` does with each microbatch (``input_dict[key] = value.to(self.device)``)."""
    for key, value in input_dict.items():
        input_dict[key] = value.clone().as_subclass(DeviceTensor)


def test_train_step_still_copies_the_batch_the_way_this_patch_listens_for():
    from torchtitan.trainer import Trainer

    assert "input_dict[key] = value.to(self.device)" in inspect.getsource(Trainer.train_step)


def test_reading_the_device_positions_back_copies_nothing(trainer_class, copies):
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    trainer, batches = _batches(trainer_class, ({"input": torch.ones(1, 5, dtype=torch.int64),
                                                 "positions": positions}, torch.ones(1, 5)))
    input_dict, labels = next(batches)
    assert trainer.metrics_processor.ntokens_since_last_log == 5  # upstream's own bookkeeping still runs
    _to_device(input_dict)
    assert host_reads.host_copy(input_dict["positions"]) is positions
    assert copies == []


def test_a_written_device_tensor_or_host_tensor_is_copied_back(trainer_class, copies):
    _, batches = _batches(trainer_class, *[({"positions": torch.arange(4).view(1, 4)}, torch.ones(1, 4))] * 2)
    first, _ = next(batches)
    _to_device(first)
    with torch.no_grad():
        first["positions"].add_(1)  # the device tensor written in place: the host tensor no longer holds it
    assert torch.equal(host_reads.host_copy(first["positions"]), torch.arange(1, 5).view(1, 4))
    assert len(copies) == 1

    second, _ = next(batches)
    host_positions = second["positions"]
    _to_device(second)
    host_positions.add_(1)  # the loader's tensor written after the copy
    host_reads.host_copy(second["positions"])
    assert len(copies) == 2


def test_a_replacement_that_is_no_copy_is_not_remembered(trainer_class, copies):
    _, batches = _batches(trainer_class, ({"positions": torch.arange(4).view(1, 4)}, torch.ones(1, 4)))
    input_dict, _ = next(batches)
    input_dict["positions"] = torch.arange(2).as_subclass(DeviceTensor)  # another shape: not the batch's copy
    host_reads.host_copy(input_dict["positions"])
    assert len(copies) == 1
