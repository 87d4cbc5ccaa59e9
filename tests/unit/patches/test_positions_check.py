"""positions_check: RoPE's bounds check on one shared host copy of the positions, not a device assert per layer.

The copy is counted through a stand-in device tensor (a CPU tensor claiming a device; host_reads' copy counted): the
check itself against upstream's semantics (positions above the cache's last index fail), and the sharing
(many layers, one copy; a new tensor or an in-place write, a new copy).
"""

from __future__ import annotations

import pytest
import torch

from host_reads_kit import DeviceTensor, applied_on_npu, count_copies
from npu_inject.patches import positions_check


@pytest.fixture
def copies(monkeypatch) -> list:
    return count_copies(monkeypatch)


@pytest.fixture
def applied(copies):
    from torchtitan.models.common import rope

    with applied_on_npu(positions_check, rope, "_maybe_check_max_pos"):
        yield rope


def _positions(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).as_subclass(DeviceTensor)


def test_positions_within_the_cache_pass_and_beyond_it_fail_with_upstreams_message(applied):
    applied._maybe_check_max_pos(_positions([[0, 1, 2, 0, 1]]), max_valid_pos=2)
    with pytest.raises(RuntimeError, match=r"position_ids exceed max_valid_pos=2 .*highest position id is 3"):
        applied._maybe_check_max_pos(_positions([[0, 1, 2, 3]]), max_valid_pos=2)


def test_every_layer_shares_one_copy_until_the_positions_change(applied, copies):
    positions = _positions([[0, 1, 2, 3]])
    for _ in range(6):  # six layers' RoPE
        applied._maybe_check_max_pos(positions, max_valid_pos=10)
    assert len(copies) == 1
    with torch.no_grad():
        positions.add_(1)  # an in-place write: the version moves
    applied._maybe_check_max_pos(positions, max_valid_pos=10)
    applied._maybe_check_max_pos(_positions([[0, 1]]), max_valid_pos=10)  # the next step's tensor
    assert len(copies) == 3


def test_fake_positions_are_not_read(applied, copies):
    """npu-inject plan records a step on fake tensors: the check has no values to read and must not ask for them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        applied._maybe_check_max_pos(torch.zeros(1, 4, dtype=torch.int64), max_valid_pos=2)
    assert copies == []
