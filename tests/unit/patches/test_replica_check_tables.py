"""replica_check's fingerprints and verdict, against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from npu_inject.patches import inject_faults, replica_check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_flipped_exponent_bit_changes_the_fingerprint_and_halves_or_doubles_the_value(dtype):
    model = torch.nn.Linear(4, 3).to(dtype)
    before = model.weight.detach().clone()
    printed = replica_check.fingerprints([model.weight.detach(), model.bias.detach()])
    assert inject_faults.flip_exponent_bit(model) == "weight"
    after = replica_check.fingerprints([model.weight.detach(), model.bias.detach()])
    assert printed[1] == after[1] and printed[0] != after[0]
    ratio = (model.weight.detach()[0, 0] / before[0, 0]).item()
    assert ratio in (0.5, 2.0) and torch.equal(model.weight.detach().view(-1)[1:], before.view(-1)[1:])


def test_the_fingerprint_is_the_integer_sum_of_the_bits():
    values = torch.tensor([1.0, -2.0, 0.5])
    expected = sum(int.from_bytes(torch.tensor([v]).numpy().tobytes(), "little", signed=True) for v in values.tolist())
    assert replica_check.fingerprints([values]).tolist() == [expected]


@pytest.mark.parametrize("table, members, found", [
    ([[1, 2], [1, 2], [1, 2]], [0, 1, 2], None),
    ([[1, 2], [1, 2], [1, 3]], [0, 4, 8], (1, [8], [0, 4])),  # the majority names the wrong replica
    ([[1, 2], [5, 2]], [0, 1], (0, [0, 1], [])),  # two replicas: no majority
    ([[1], [2], [3]], [0, 1, 2], (0, [0, 1, 2], [])),  # three values: none is a majority
])
def test_the_first_differing_tensor_and_the_minority(table, members, found):
    assert replica_check.disagreement(table, members) == found


@pytest.mark.parametrize("table, column, found", [
    ([[1, 2], [1, 2], [1, 3]], 1, (0, [8])),  # a rank of the majority sends, the minority receives
    ([[1, 2], [5, 2], [5, 2]], 0, (4, [0])),
    ([[1], [2]], 0, (None, [0, 4])),  # two replicas that differ: no majority
])
def test_the_majority_names_a_source_and_the_ranks_to_repair(table, column, found):
    assert replica_check.majority(table, column, [0, 4, 8][:len(table)]) == found


@pytest.mark.parametrize("table, mine, expected", [
    ([[1, 2], [1, 2], [1, 2]], 0, None),
    ([[1, 2], [1, 9], [1, 2]], 1, ("stop", "this replica group (b) disagrees with the majority of the torchft replica "
                                           "groups in w2 (1 of 2 tensors differ): it leaves the quorum")),
    ([[1, 2], [1, 9], [1, 2]], 0, ("train on", "replica group b disagreed with the majority of the torchft replica "
                                               "groups in w2 (1 of 2 tensors differ) and leaves the quorum")),
    ([[1, 2], [5, 9]], 0, ("stop", "the torchft replica groups' w1 (2 of 2 tensors differ) and no majority says which "
                                   "group is wrong (replica group a, replica group b)")),
])
def test_torchft_replica_groups_verdict(table, mine, expected):
    verdict = replica_check.group_verdict(table, mine, ["a", "b", "c"][:len(table)], ["w1", "w2"])
    if expected is None:
        assert verdict is None
    else:
        assert verdict[0] == expected[0] and verdict[1].startswith(expected[1]), verdict
