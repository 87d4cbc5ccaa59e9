"""torchft_heal's live state: a module's own tensors, as torch's state_dict holds them, without its hooks."""

from __future__ import annotations

import torch
from torch import nn

from npu_inject.patches.torchft_heal import module_tensors, rebased_counters


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model.register_buffer("cache", torch.ones(2), persistent=False)
    return model


def test_the_live_state_is_torchs_state_dict_sharing_the_modules_storage():
    model = _model()
    expected = model.state_dict()
    tensors = module_tensors([model])
    assert list(tensors) == list(expected)  # the buffer not saved with the module is not served either
    for key, tensor in tensors.items():
        assert torch.equal(tensor, expected[key]) and tensor.data_ptr() == expected[key].data_ptr(), key
        assert not tensor.requires_grad


def test_a_state_dict_hook_that_rewrites_entries_does_not_run():
    model = _model()

    def split(module, state_dict, prefix, local_metadata):  # as torchtitan's fused-QKV split rewrites wqkv
        state_dict[prefix + "0.weight_split"] = state_dict.pop(prefix + "0.weight")[:1]

    model.register_state_dict_post_hook(split)
    assert "0.weight_split" in model.state_dict()
    tensors = module_tensors([model])
    assert "0.weight" in tensors and "0.weight_split" not in tensors
    assert tensors["0.weight"].shape == (3, 2)


def test_a_healed_train_state_is_the_peers_at_its_quorum_plus_what_this_rank_counted_since_its_own():
    # step-synchronous: the peer served its state from before this step's batch; this rank counted its batch
    served = {"step": 7, "ntokens_seen": 768}
    assert rebased_counters(served, {"step": 1, "ntokens_seen": 0}, {"step": 1, "ntokens_seen": 128}) == {
        "step": 7, "ntokens_seen": 896}
    # a DiLoCo window: the quorum began 2 steps before the load
    assert rebased_counters(served, {"step": 3, "ntokens_seen": 384}, {"step": 5, "ntokens_seen": 640}) == {
        "step": 9, "ntokens_seen": 1024}
    # entries that are not counters on both sides pass through as served
    assert rebased_counters({"step": 7, "name": "x"}, {}, {"step": 1}) == {"step": 7, "name": "x"}
