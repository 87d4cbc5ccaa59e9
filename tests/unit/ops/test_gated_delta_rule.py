"""The chunked gated delta rule (qwen3_5's linear attention) against the token-by-token recurrence.

The oracle is written from the paper's recurrence (Gated Delta Networks, Yang et al. 2024),
one token at a time, sharing nothing with the chunked solve: outputs, final states and
gradients must agree, across chunk boundaries, packed sequences and grouped heads.
"""

from __future__ import annotations

import pytest
import torch

from npu_inject.ops.reference.gated_delta_rule import CHUNK, npu_chunk_gated_delta_rule
from kernelkit import recurrent_oracle


def inputs(lengths, Nk=2, Nv=4, Dk=8, Dv=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = torch.nn.functional.normalize(rand(T, Nk, Dk), dim=-1)
    k = torch.nn.functional.normalize(rand(T, Nk, Dk), dim=-1)
    v = rand(T, Nv, Dv)
    beta = torch.sigmoid(rand(T, Nv))
    g = -torch.nn.functional.softplus(rand(T, Nv))  # log decays, alpha in (0, 1)
    state = 0.1 * rand(len(lengths), Nv, Dv, Dk)
    return [t.requires_grad_() for t in (q, k, v, beta, g, state)]


@pytest.mark.parametrize("lengths", [[CHUNK + 7], [5, 2 * CHUNK + 3, 1], [CHUNK]])
def test_chunked_matches_the_recurrence_with_gradients(lengths):
    q, k, v, beta, g, state = inputs(lengths)
    scale = q.shape[-1] ** -0.5
    # float64 inputs: the reference computes in float32, so compare at float32 precision.
    out, final = npu_chunk_gated_delta_rule(q, k, v, beta=beta, initial_state=state,
                                            actual_seq_lengths=torch.tensor(lengths), scale=scale, g=g)
    expected_out, expected_final = recurrent_oracle(q, k, v, beta, g, state, lengths, scale)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, expected_final, atol=2e-5, rtol=1e-4)

    weights_out, weights_final = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out * weights_out).sum() + (final * weights_final).sum(), (q, k, v, beta, g, state))
    want = torch.autograd.grad((expected_out * weights_out).sum() + (expected_final * weights_final).sum(),
                               (q, k, v, beta, g, state))
    for name, got_grad, want_grad in zip("q k v beta g state".split(), got, want):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"d{n}: {m}")


def test_defaults_zero_state_no_decay_and_documented_scale():
    q, k, v, beta, _, _ = inputs([9], Nk=1, Nv=1)
    out, final = npu_chunk_gated_delta_rule(q, k, v, beta=beta)
    zeros_state = torch.zeros(1, 1, v.shape[-1], q.shape[-1], dtype=torch.float64)
    expected_out, expected_final = recurrent_oracle(q, k, v, beta, torch.zeros_like(beta), zeros_state, [9],
                                                    q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, expected_final, atol=2e-5, rtol=1e-4)
    assert out.dtype == v.dtype and out.shape == v.shape


def test_bad_arguments_name_the_parameter():
    q, k, v, beta, g, state = inputs([4])
    with pytest.raises(ValueError, match="beta is required"):
        npu_chunk_gated_delta_rule(q, k, v)
    with pytest.raises(ValueError, match="actual_seq_lengths sum to 3"):
        npu_chunk_gated_delta_rule(q, k, v, beta=beta, actual_seq_lengths=torch.tensor([3]))
