"""rms_norm, rotary, swiglu and router_fp32 on torchtitan's own modules, against independent math.

The runtime applies the four patches in the CPU rehearsal (reference kernels); expected
values are written here from the formulas (F.rms_norm, RoPE angles, F.silu(a) * b, a float32
F.linear), never from npu_inject's glue or reference kernels.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from testkit import clean_env
from npu_inject import runtime

FUSED_PATCHES = ("rms_norm", "rotary", "swiglu", "router_fp32")


@pytest.fixture
def fused():
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=",".join(FUSED_PATCHES)))
    for module in ("torchtitan.models.common.nn_modules", "torchtitan.models.common.rope",
                   "torchtitan.models.common.feed_forward", "torchtitan.models.common.moe"):
        importlib.import_module(module)
    for patch in FUSED_PATCHES:
        assert rt.report.patches[patch].state == "applied", rt.report.patches[patch].reason
    return rt


def _leaf(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def test_rms_norm_module_matches_f_rms_norm(fused):
    from torchtitan.models.common.nn_modules import RMSNorm

    norm = RMSNorm(RMSNorm.Config(normalized_shape=16, eps=1e-5))
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = _leaf(2, 5, 16, seed=0)
    out = norm(x)
    out.square().sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    expected = F.rms_norm(x_ref, (16,), w_ref, eps=1e-5)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((x.grad, norm.weight.grad), (x_ref.grad, w_ref.grad))
    assert [name for name, _ in norm.named_parameters()] == ["weight"]


def test_rms_norm_gives_the_kernel_a_contiguous_input(fused, monkeypatch):
    # torch_npu's meta for npu_rms_norm is empty_like(self): a transposed sequence-parallel shard
    # would give a transposed output under compile, which MoE's view() of ffn_norm's output rejects.
    from npu_inject.ops import reference
    from torchtitan.models.common.nn_modules import RMSNorm

    def meta_like_npu_rms_norm(x, gamma, epsilon):
        return torch.empty_like(x), torch.empty(x.shape[:-1] + (1,))

    monkeypatch.setattr(reference, "npu_rms_norm", meta_like_npu_rms_norm)  # the rehearsal's kernels()
    norm = RMSNorm(RMSNorm.Config(normalized_shape=16, eps=1e-5))
    x_BLD = torch.randn(6, 2, 16).transpose(0, 1)  # (B, L, D) over (L, B, D) memory
    assert norm(x_BLD).view(12, 16).shape == (12, 16)


def test_complex_rope_takes_a_complex_cache_built_elsewhere(fused):
    # muse_glimmer's vision encoder builds its own (N, P, 1, H/2) complex cache per forward and calls
    # ComplexRoPE.apply_rotary_emb: pairs (x_2i, x_2i+1) rotate by cis(angle), written out here.
    from torchtitan.models.common.rope import ComplexRoPE

    angles = torch.rand(2, 4, 1, 4, dtype=torch.float64) * 6
    cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    q, k = _leaf(2, 4, 3, 8, seed=1), _leaf(2, 4, 3, 8, seed=2)
    q_out, k_out = ComplexRoPE.apply_rotary_emb(q, k, cis)
    cos, sin = angles.cos().float(), angles.sin().float()
    for x, out in ((q, q_out), (k, k_out)):
        even, odd = x[..., ::2], x[..., 1::2]
        expected = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        torch.testing.assert_close(out, expected)


def _angles(dim, positions, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.to(torch.float64)[..., None] * inv_freq  # (..., L, dim/2)


@pytest.mark.parametrize("per_sample_positions", [False, True])
def test_complex_rope_keeps_a_real_cache_and_rotates_pairs(fused, per_sample_positions):
    from torchtitan.models.common.rope import ComplexRoPE

    rope = ComplexRoPE(ComplexRoPE.Config(dim=8, max_seq_len=32))
    assert not rope.cache.is_complex() and rope.cache.shape == (32, 16)
    assert "cache" not in rope.state_dict()  # non-persistent: never in a checkpoint
    q, k = _leaf(2, 6, 4, 8, seed=1), _leaf(2, 6, 1, 8, seed=2)
    positions = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]]) if per_sample_positions else None
    q_out, k_out = rope(q, k, positions)
    angles = _angles(8, positions if per_sample_positions else torch.arange(6).expand(2, 6))[:, :, None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    for x, out in ((q, q_out), (k, k_out)):
        even, odd = x[..., 0::2].detach(), x[..., 1::2].detach()  # (x_2i + i x_2i+1) * (cos + i sin)
        expected = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        torch.testing.assert_close(out, expected)
    q_out.sum().backward()
    assert q.grad.shape == q.shape and torch.isfinite(q.grad).all()


def test_cos_sin_rope_rotates_halves(fused):
    from torchtitan.models.common.rope import CosSinRoPE

    rope = CosSinRoPE(CosSinRoPE.Config(dim=8, max_seq_len=32, theta=1000.0))
    q, k = _leaf(2, 6, 4, 8, seed=3), _leaf(2, 6, 2, 8, seed=4)
    q_out, k_out = rope(q, k)
    angles = _angles(8, torch.arange(6), theta=1000.0)[None, :, None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    for x, out in ((q, q_out), (k, k_out)):
        x = x.detach()
        torch.testing.assert_close(out, x * cos + torch.cat([-x[..., 4:], x[..., :4]], -1) * sin)


def test_feed_forward_swiglu_matches_silu_gate_times_up(fused):
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear

    ffn = FeedForward(FeedForward.Config(w1=Linear.Config(in_features=12, out_features=20),
                                         w2=Linear.Config(in_features=20, out_features=12),
                                         w3=Linear.Config(in_features=12, out_features=20)))
    for i, p in enumerate(ffn.parameters()):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + i)) * 0.3)
    x = _leaf(3, 5, 12, seed=5)
    out = ffn(x)
    expected = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(out, expected)
    assert sorted(name for name, _ in ffn.named_parameters()) == ["w1.weight", "w2.weight", "w3.weight"]
    grads = torch.autograd.grad(out.sum(), [x, ffn.w1.weight])
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), [x, ffn.w1.weight]))


def test_grouped_experts_swiglu_matches_expert_loop_in_bf16(fused):
    from torchtitan.models.common.moe import GroupedExperts

    experts = GroupedExperts(GroupedExperts.Config(dim=16, hidden_dim=8, num_experts=3))
    for i, p in enumerate(experts.parameters()):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(20 + i)) * 0.3)
    counts = [4, 0, 3]
    x = _leaf(7, 16, seed=6)
    out = experts(x, torch.tensor(counts))
    rows, start = [], 0
    for e, count in enumerate(counts):  # upstream's bf16 matmuls; silu(gate) * up rounded once
        xe = x.detach()[start:start + count].bfloat16().float()
        gate = (xe @ experts.w1_EFD[e].detach().bfloat16().float().T).bfloat16().float()
        up = (xe @ experts.w3_EFD[e].detach().bfloat16().float().T).bfloat16().float()
        h = (F.silu(gate) * up).bfloat16().float()
        rows.append(h @ experts.w2_EDF[e].detach().bfloat16().float().T)
        start += count
    torch.testing.assert_close(out, torch.cat(rows), atol=2e-2, rtol=2e-2)
    assert out.dtype == x.dtype


@pytest.mark.parametrize("gate_up_dim, contiguous", [(0, True), (-2, False)])
def test_swiglu_stacked_first_gives_the_projections_contiguous_gradients(fused, gate_up_dim, contiguous):
    """The experts stack (gate, up) first: a grouped matmul's backward needs a contiguous gradient, and under
    torch.compile a data-dependent row count makes a strided one fail (tests/cann_emu/test_compile_emulated.py)."""
    from npu_inject.ops.swiglu import swiglu

    gate, up = _leaf(5, 4, seed=30), _leaf(5, 4, seed=31)
    out = swiglu(gate, up, gate_up_dim=gate_up_dim)
    torch.testing.assert_close(out, F.silu(gate) * up)
    grad_gate, grad_up = torch.autograd.grad(out, [gate, up], torch.ones(5, 4), retain_graph=True)
    torch.testing.assert_close([grad_gate, grad_up], list(torch.autograd.grad((F.silu(gate) * up).sum(), [gate, up])))
    captured = []
    for leaf in (gate, up):
        leaf.register_hook(lambda grad: captured.append(grad.is_contiguous()))
    out.backward(torch.ones(5, 4))
    assert captured == [contiguous, contiguous]


def test_router_gate_computes_in_float32_for_bf16_inputs(fused):
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    router = TokenChoiceTopKRouter(TokenChoiceTopKRouter.Config(
        num_experts=5, gate=Linear.Config(in_features=16, out_features=5), top_k=2)).to(torch.bfloat16)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(5, 16, generator=torch.Generator().manual_seed(7)))
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(8)).bfloat16()
    _, _, scores = router(x)
    expected = torch.sigmoid(F.linear(x.float(), router.gate.weight.float()))
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected)  # a bf16 gate would be off by ~1e-2
    with torch.no_grad():
        bf16_scores = torch.sigmoid(F.linear(x, router.gate.weight).float())
    assert not torch.equal(bf16_scores, expected)  # the bf16 gate differs: the test can tell them apart


def test_revert_restores_upstream(fused):
    from torchtitan.models.common.rope import ComplexRoPE

    runtime.deactivate()
    assert ComplexRoPE(ComplexRoPE.Config(dim=8, max_seq_len=4)).cache.is_complex()
