"""Reference npu_rms_norm, npu_rotary_mul and npu_swiglu (and their backward ops) against
independent PyTorch math: F.rms_norm, torchtitan's own RoPE formulas, F.silu(a) * b.

The backward ops are what the simulated NPU's stand-in wires as the kernels' autograd
formulas (verification/sim_npu/site/torch_npu/_block_ops.py); they are checked against autograd
of the independent forward, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npu_inject.ops import reference


def _grads(fn, *inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, grad_out)


# -- rms_norm --------------------------------------------------------------------------


@pytest.mark.parametrize("shape, normalized", [((2, 5, 16), (16,)), ((3, 4, 6, 8), (6, 8))])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_torch(shape, normalized, dtype, tolerance):
    x = torch.randn(shape).to(dtype)
    gamma = torch.rand(normalized).to(dtype) + 0.5
    out, rstd = reference.npu_rms_norm(x, gamma, epsilon=1e-5)
    expected = F.rms_norm(x.float(), normalized, gamma.float(), eps=1e-5)
    assert out.dtype == dtype and rstd.dtype == torch.float32
    assert rstd.shape == (*shape[: len(shape) - len(normalized)], *([1] * len(normalized)))
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    dims = tuple(range(len(shape) - len(normalized), len(shape)))
    torch.testing.assert_close(rstd, 1 / x.float().pow(2).mean(dims, keepdim=True).add(1e-5).sqrt())


def test_rms_norm_output_is_contiguous_like_torchs_for_a_transposed_input():
    # A sequence-parallel shard's layout: (B, L, D) viewed over (L, B, D) memory. torch's
    # rms_norm returns a contiguous output, and torchtitan's MoE views the ffn_norm output.
    x = torch.randn(6, 2, 16).to(torch.bfloat16).transpose(0, 1)
    gamma = torch.rand(16).to(torch.bfloat16) + 0.5
    out, _ = reference.npu_rms_norm(x, gamma, epsilon=1e-5)
    expected = F.rms_norm(x, (16,), gamma, eps=1e-5)
    assert expected.is_contiguous()
    assert out.is_contiguous()
    out.view(12, 16)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_rms_norm_backward_matches_autograd_of_torch():
    x, gamma = torch.randn(3, 7, 12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    dy = torch.randn(3, 7, 12, dtype=torch.float64)
    _, rstd = reference.npu_rms_norm(x, gamma, epsilon=1e-6)
    dx, dgamma = reference.npu_rms_norm_backward(dy, x, gamma, rstd)
    expected = _grads(lambda a, g: F.rms_norm(a, (12,), g, eps=1e-6), x, gamma, grad_out=dy)
    torch.testing.assert_close((dx, dgamma), expected)


def test_rms_norm_rejects_gamma_that_is_not_the_trailing_shape():
    with pytest.raises(ValueError, match="trailing dims"):
        reference.npu_rms_norm(torch.randn(2, 8), torch.randn(4))


# -- rotary_mul ------------------------------------------------------------------------


def _torchtitan_rope(rope_cls, dim, seq_len, **config):
    return rope_cls(rope_cls.Config(dim=dim, max_seq_len=seq_len, **config))


@pytest.mark.parametrize("batch_cache", [False, True])
def test_rotary_half_is_cos_sin_rope(batch_cache):
    from torchtitan.models.common.rope import CosSinRoPE

    rope = _torchtitan_rope(CosSinRoPE, 16, 32)
    q, k = torch.randn(2, 10, 4, 16), torch.randn(2, 10, 2, 16)
    positions = torch.randint(0, 32, (2, 10)) if batch_cache else None
    cache = rope._reshape_cache(q, positions)
    expected_q, expected_k = CosSinRoPE.apply_rotary_emb(q, k, cache)
    cos, sin = cache[..., :16], cache[..., 16:]
    torch.testing.assert_close(reference.npu_rotary_mul(q, cos, sin, "half"), expected_q)
    torch.testing.assert_close(reference.npu_rotary_mul(k, cos, sin, "half"), expected_k)


@pytest.mark.parametrize("scaling", [{}, {"scaling": "llama"}, {"scaling": "yarn", "rope_factor": 4.0}])
def test_rotary_interleave_is_complex_rope(scaling):
    from torchtitan.models.common.rope import ComplexRoPE

    rope = _torchtitan_rope(ComplexRoPE, 16, 64, **scaling)
    q, k = torch.randn(2, 12, 4, 16), torch.randn(2, 12, 1, 16)
    expected_q, expected_k = ComplexRoPE.apply_rotary_emb(q, k, rope._reshape_cache(q))
    cis = rope.cache[:12]  # (L, H/2) complex: cos/sin of each pair's angle
    cos = cis.real.repeat_interleave(2, -1)[None, :, None, :]
    sin = cis.imag.repeat_interleave(2, -1)[None, :, None, :]
    torch.testing.assert_close(reference.npu_rotary_mul(q, cos, sin, "interleave"), expected_q)
    torch.testing.assert_close(reference.npu_rotary_mul(k, cos, sin, "interleave"), expected_k)


def test_rotary_interleave_follows_the_docs_formula():
    x, r1, r2 = torch.randn(1, 3, 2, 6), torch.randn(1, 3, 1, 6), torch.randn(1, 3, 1, 6)
    # Docs: x_new = rearrange(stack((-x2, x1), -1), '... d two -> ...(d two)') with x1 = x[..., ::2], x2 = x[..., 1::2].
    x_new = torch.empty_like(x)
    x_new[..., 0::2], x_new[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    torch.testing.assert_close(reference.npu_rotary_mul(x, r1, r2, "interleave"), r1 * x + r2 * x_new)


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("r_shape", [(1, 5, 1, 8), (2, 5, 1, 8), (2, 5, 3, 8)])
def test_rotary_backward_matches_autograd(mode, r_shape):
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    r1, r2 = torch.randn(r_shape, dtype=torch.float64), torch.randn(r_shape, dtype=torch.float64)
    grad = torch.randn_like(x)

    def independent(a, c, s):  # the docs' formula, written with explicit indexing
        if mode == "half":
            rotated = torch.cat([-a[..., 4:], a[..., :4]], -1)
        else:
            rotated = torch.stack([-a[..., 1::2], a[..., ::2]], -1).reshape(a.shape)
        return c * a + s * rotated

    expected = _grads(independent, x, r1, r2, grad_out=grad)
    torch.testing.assert_close(reference.npu_rotary_mul_backward(grad, x, r1, r2, mode), expected)


def test_rotary_rejects_rotate_and_unknown_modes():
    x = torch.randn(1, 2, 1, 4)
    with pytest.raises(NotImplementedError, match="rotate"):
        reference.npu_rotary_mul(x, x, x, "half", torch.eye(4))
    with pytest.raises(ValueError, match="rotary_mode"):
        reference.npu_rotary_mul(x, x, x, "quarter")


# -- swiglu ----------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [-1, -2, 0])
def test_swiglu_is_silu_gate_times_up(dim):
    x = torch.randn(4, 6, 10)
    a, b = x.chunk(2, dim=dim)
    torch.testing.assert_close(reference.npu_swiglu(x, dim=dim), F.silu(a) * b)


def test_swiglu_backward_matches_autograd():
    x = torch.randn(3, 2, 10, dtype=torch.float64)
    grad = torch.randn(3, 2, 5, dtype=torch.float64)
    (expected,) = _grads(lambda t: F.silu(t[..., :5]) * t[..., 5:], x, grad_out=grad)
    torch.testing.assert_close(reference.npu_swiglu_backward(grad, x, dim=-1), expected)


def test_swiglu_bf16_rounds_once():
    x = torch.randn(64, 32).bfloat16()
    a, b = x.float().chunk(2, -1)
    torch.testing.assert_close(reference.npu_swiglu(x), (F.silu(a) * b).bfloat16())
