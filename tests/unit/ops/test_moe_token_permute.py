"""npu_inject.ops.reference.npu_moe_token_permute / unpermute against independent math.

Expected values come from hand computation, explicit sorting and the worked examples in
torch_npu 2.14.0's ``_op_plugin_docs.py``; the reference is never compared with itself.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kernelkit import NODEF, POS, generator, randn
from npu_inject.ops import reference as ref


# _op_plugin_docs.py, "npu_moe_token_permute", 接口原型.
PERMUTE_SIGNATURE = [
    ("tokens", POS, NODEF), ("indices", POS, NODEF), ("num_out_tokens", POS, None), ("padded_mode", POS, False),
]


def test_permute_signature_matches_docs():
    parameters = inspect.signature(ref.npu_moe_token_permute).parameters.values()
    assert [(p.name, p.kind, p.default) for p in parameters] == PERMUTE_SIGNATURE


# _op_plugin_docs.py, "npu_moe_token_unpermute", 接口原型.
UNPERMUTE_SIGNATURE = [
    ("permuted_tokens", POS, NODEF), ("sorted_indices", POS, NODEF), ("probs", POS, None),
    ("padded_mode", POS, False), ("restore_shape", POS, None),
]


def test_unpermute_signature_matches_docs():
    parameters = inspect.signature(ref.npu_moe_token_unpermute).parameters.values()
    assert [(p.name, p.kind, p.default) for p in parameters] == UNPERMUTE_SIGNATURE


def test_permute_unpermute_doc_examples():
    # _op_plugin_docs.py (second entries): the permute example's inputs, and the unpermute
    # example whose permuted_tokens / sorted_indices are exactly what that permute yields.
    tokens = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16)
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]])
    permuted, sorted_indices = ref.npu_moe_token_permute(tokens, indices)
    assert permuted.dtype == torch.float16 and sorted_indices.dtype == torch.int32
    assert permuted.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4], [1, 1], [2, 2], [3, 3], [4, 4]]
    assert sorted_indices.tolist() == [0, 4, 5, 1, 2, 6, 7, 3]
    # Documented contract: permuted_tokens[sorted_indices[i]] == tokens[i // topK].
    for i in range(8):
        assert torch.equal(permuted[sorted_indices[i]], tokens[i // 2])
    probs = torch.ones((4, 2), dtype=torch.float16) / 2
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    assert out.dtype == torch.float16 and out.tolist() == tokens.tolist()


def test_permute_hand_computed_1d_indices_and_drop():
    tokens = torch.tensor([[10.0], [20.0], [30.0], [40.0], [50.0]])
    indices = torch.tensor([2, 0, 2, 1, 0], dtype=torch.int32)  # topK = 1
    # Stable sort by expert: expert 0 <- tokens 1, 4; expert 1 <- 3; expert 2 <- 0, 2.
    permuted, sorted_indices = ref.npu_moe_token_permute(tokens, indices)
    assert permuted.flatten().tolist() == [20, 50, 40, 10, 30]
    assert sorted_indices.tolist() == [3, 0, 4, 2, 1]
    for num_out, kept in ((3, 3), (-1, 4), (0, 5), (None, 5), (99, 5)):
        permuted, sorted_indices = ref.npu_moe_token_permute(tokens, indices, num_out)
        assert permuted.flatten().tolist() == [20, 50, 40, 10, 30][:kept]
        assert sorted_indices.tolist() == [3, 0, 4, 2, 1]  # always num_tokens * topK entries
    # Unpermuting after a drop: dropped slots (row index >= 3) contribute 0.
    permuted, sorted_indices = ref.npu_moe_token_permute(tokens, indices, 3)
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices)
    assert out.flatten().tolist() == [0, 20, 0, 40, 50]


def test_permute_round_trip():
    num_tokens, hidden, experts, topk = 11, 6, 5, 3
    tokens = randn(num_tokens, hidden, seed=95)
    indices = torch.stack([torch.randperm(experts, generator=generator(96 + t))[:topk] for t in range(num_tokens)])
    permuted, sorted_indices = ref.npu_moe_token_permute(tokens, indices)
    # Every expert's rows are contiguous and in expert order.
    slot_of_row = torch.argsort(sorted_indices.long())
    experts_of_rows = indices.flatten()[slot_of_row]
    assert torch.all(experts_of_rows[1:] >= experts_of_rows[:-1])
    # Stable: within one expert, rows keep the (token, k) slot order.
    same_expert = experts_of_rows[1:] == experts_of_rows[:-1]
    assert torch.all(slot_of_row[1:][same_expert] > slot_of_row[:-1][same_expert])
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.full((num_tokens, topk), 1.0 / topk))
    torch.testing.assert_close(out, tokens, atol=1e-6, rtol=1e-6)
    probs = torch.rand(num_tokens, topk, generator=generator(97))
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    torch.testing.assert_close(out, tokens * probs.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)


def test_permute_unpermute_gradcheck():
    tokens = torch.randn(4, 3, dtype=torch.float64, generator=generator(98), requires_grad=True)
    indices = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 2]])
    assert torch.autograd.gradcheck(lambda t: ref.npu_moe_token_permute(t, indices)[0], (tokens,))
    assert torch.autograd.gradcheck(lambda t: ref.npu_moe_token_permute(t, indices, 5)[0], (tokens,))
    _, sorted_indices = ref.npu_moe_token_permute(tokens.detach(), indices)
    permuted = torch.randn(8, 3, dtype=torch.float64, generator=generator(99), requires_grad=True)
    probs = torch.rand(4, 2, dtype=torch.float64, generator=generator(100), requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda p, w: ref.npu_moe_token_unpermute(p, sorted_indices, probs=w), (permuted, probs)
    )
    # Gradient to probs is the dot product of each slot's row with the upstream gradient.
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    rows = permuted.detach()[sorted_indices.long()].reshape(4, 2, 3)
    torch.testing.assert_close(probs.grad, (rows * g.unsqueeze(1)).sum(-1))


def test_permute_unpermute_bf16_and_errors():
    tokens = randn(4, 8, seed=101, dtype=torch.bfloat16)
    indices = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]])
    permuted, sorted_indices = ref.npu_moe_token_permute(tokens, indices)
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.full((4, 2), 0.5, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, tokens)
    with pytest.raises(NotImplementedError, match="padded_mode"):
        ref.npu_moe_token_permute(tokens, indices, padded_mode=True)
    with pytest.raises(NotImplementedError, match="padded_mode"):
        ref.npu_moe_token_unpermute(permuted, sorted_indices, padded_mode=True)
    with pytest.raises(ValueError, match="restore_shape"):
        ref.npu_moe_token_unpermute(permuted, sorted_indices, restore_shape=[4, 8])
    with pytest.raises(ValueError, match="non-negative"):
        ref.npu_moe_token_permute(tokens, -indices - 1)
    with pytest.raises(ValueError, match="probs"):
        ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.ones(4, 3))
