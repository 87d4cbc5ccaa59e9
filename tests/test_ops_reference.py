"""Tests of npu_inject.ops.reference against independent math.

Expected values come from explicit loops, hand computation, torch's own
scaled_dot_product_attention (whose attn_mask is True = KEEP, the opposite of torch_npu's
atten_mask) and the worked examples in torch_npu 2.14.0's ``_op_plugin_docs.py``; the
reference is never compared with itself.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from npu_inject.ops import reference as ref

COMPRESSED = torch.triu(torch.ones(2048, 2048), diagonal=1).bool()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    t = torch.randn(*shape, generator=_gen(seed), dtype=torch.float32).to(dtype)
    return t.requires_grad_(requires_grad)


# --------------------------------------------------------------------------------------
# Signatures: hard-coded from torch_npu 2.14.0 _op_plugin_docs.py
# --------------------------------------------------------------------------------------

P = inspect.Parameter
POS, KW = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY
NODEF = P.empty

DOCUMENTED_SIGNATURES = {
    # _op_plugin_docs.py, "npu_fusion_attention", 接口原型.
    "npu_fusion_attention": [
        ("query", POS, NODEF), ("key", POS, NODEF), ("value", POS, NODEF), ("head_num", POS, NODEF),
        ("input_layout", POS, NODEF), ("pse", POS, None), ("padding_mask", POS, None), ("atten_mask", POS, None),
        ("scale", POS, 1.0), ("keep_prob", POS, 1.0), ("pre_tockens", POS, 2147483647),
        ("next_tockens", POS, 2147483647), ("inner_precise", POS, 0), ("prefix", POS, None),
        ("actual_seq_qlen", POS, None), ("actual_seq_kvlen", POS, None), ("sparse_mode", POS, 0),
        ("gen_mask_parallel", POS, True), ("sync", POS, False), ("softmax_layout", POS, ""),
    ],
    # _op_plugin_docs.py, "npu_grouped_matmul", 接口原型 (tuning_config has no default there;
    # the schema in csrc/aten/npu_native_functions_by_codegen.yaml gives None).
    "npu_grouped_matmul": [
        ("x", POS, NODEF), ("weight", POS, NODEF), ("bias", KW, None), ("scale", KW, None), ("offset", KW, None),
        ("antiquant_scale", KW, None), ("antiquant_offset", KW, None), ("per_token_scale", KW, None),
        ("group_list", KW, None), ("activation_input", KW, None), ("activation_quant_scale", KW, None),
        ("activation_quant_offset", KW, None), ("split_item", KW, 0), ("group_type", KW, None),
        ("group_list_type", KW, 0), ("act_type", KW, 0), ("output_dtype", KW, None), ("tuning_config", KW, None),
    ],
    # _op_plugin_docs.py, "npu_moe_token_permute", 接口原型.
    "npu_moe_token_permute": [
        ("tokens", POS, NODEF), ("indices", POS, NODEF), ("num_out_tokens", POS, None), ("padded_mode", POS, False),
    ],
    # _op_plugin_docs.py, "npu_moe_token_unpermute", 接口原型.
    "npu_moe_token_unpermute": [
        ("permuted_tokens", POS, NODEF), ("sorted_indices", POS, NODEF), ("probs", POS, None),
        ("padded_mode", POS, False), ("restore_shape", POS, None),
    ],
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_SIGNATURES))
def test_signature_matches_docs(name):
    params = inspect.signature(getattr(ref, name)).parameters.values()
    got = [(p.name, p.kind, p.default) for p in params]
    assert got == DOCUMENTED_SIGNATURES[name]


# --------------------------------------------------------------------------------------
# npu_fusion_attention: independent expectations
# --------------------------------------------------------------------------------------


def keep_mask(sq, skv, rule):
    """Boolean (Sq, Skv), True = keep, built element by element from a rule(i, j)."""
    return torch.tensor([[bool(rule(i, j)) for j in range(skv)] for i in range(sq)])


def expected_attention(q_BNSD, k_BKSD, v_BKSD, keep=None, scale=1.0, pse=None):
    """float64 softmax(scale*(qk^T + pse)) v with repeat_interleave'd KV; empty rows -> 0."""
    n, nkv = q_BNSD.shape[1], k_BKSD.shape[1]
    q = q_BNSD.double()
    k = k_BKSD.double().repeat_interleave(n // nkv, dim=1)
    v = v_BKSD.double().repeat_interleave(n // nkv, dim=1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse.double()
    s = s * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def sdpa(q_BNSD, k_BKSD, v_BKSD, keep=None, scale=1.0):
    n, nkv = q_BNSD.shape[1], k_BKSD.shape[1]
    k = k_BKSD.repeat_interleave(n // nkv, dim=1)
    v = v_BKSD.repeat_interleave(n // nkv, dim=1)
    return F.scaled_dot_product_attention(q_BNSD, k, v, attn_mask=keep, scale=scale)


def to_layout(t_BNSD, layout):
    b, n, s, d = t_BNSD.shape
    if layout == "BNSD":
        return t_BNSD
    if layout == "BSND":
        return t_BNSD.transpose(1, 2)
    if layout == "BSH":
        return t_BNSD.transpose(1, 2).reshape(b, s, n * d)
    if layout == "SBH":
        return t_BNSD.permute(2, 0, 1, 3).reshape(s, b, n * d)
    raise AssertionError(layout)


def from_layout(t, layout, n):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, n, h // n).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, n, h // n).permute(1, 2, 0, 3)
    raise AssertionError(layout)


def fa(q, k, v, n, layout, **kw):
    return ref.npu_fusion_attention(q, k, v, n, layout, **kw)


def test_hand_computed_two_tokens():
    # One head, D=1: q = [1, 2], k = [1, 0], v = [1, 3], scale 1.
    q = torch.tensor([1.0, 2.0]).reshape(1, 1, 2, 1)
    k = torch.tensor([1.0, 0.0]).reshape(1, 1, 2, 1)
    v = torch.tensor([1.0, 3.0]).reshape(1, 1, 2, 1)
    e = math.e
    out, smax, ssum, *_ = fa(q, k, v, 1, "BNSD")
    # Row 0 scores [1, 0]; row 1 scores [2, 0].
    assert out.flatten().tolist() == pytest.approx([(e + 3) / (e + 1), (e**2 + 3) / (e**2 + 1)], rel=1e-6)
    assert smax[0, 0, :, 0].tolist() == pytest.approx([1.0, 2.0])
    assert ssum[0, 0, :, 0].tolist() == pytest.approx([1 + 1 / e, 1 + e**-2], rel=1e-6)
    # leftUpCausal: row 0 sees only key 0.
    out, *_ = fa(q, k, v, 1, "BNSD", atten_mask=COMPRESSED, sparse_mode=2)
    assert out.flatten().tolist() == pytest.approx([1.0, (e**2 + 3) / (e**2 + 1)], rel=1e-6)
    # Sq=1 < Skv=2: rightDownCausal lets the one query row see both keys, leftUpCausal one.
    out3, *_ = fa(q[:, :, 1:], k, v, 1, "BNSD", atten_mask=COMPRESSED, sparse_mode=3)
    out2, *_ = fa(q[:, :, 1:], k, v, 1, "BNSD", atten_mask=COMPRESSED, sparse_mode=2)
    assert out3.item() == pytest.approx((e**2 + 3) / (e**2 + 1), rel=1e-6)
    assert out2.item() == pytest.approx(1.0)
    # scale multiplies q.k: scale 0.5 on row 1 -> scores [1, 0].
    out, *_ = fa(q[:, :, 1:], k, v, 1, "BNSD", scale=0.5)
    assert out.item() == pytest.approx((e + 3) / (e + 1), rel=1e-6)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
@pytest.mark.parametrize("nkv", [4, 2, 1])
def test_layouts_and_gqa_match_sdpa(layout, nkv):
    b, n, sq, skv, d = 2, 4, 5, 7, 8
    q = _randn(b, n, sq, d, seed=1)
    k = _randn(b, nkv, skv, d, seed=2)
    v = _randn(b, nkv, skv, d, seed=3)
    out, smax, ssum, sout, seed, offset, numels = fa(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), n, layout, scale=d**-0.5
    )
    assert out.shape == to_layout(q, layout).shape and out.dtype == torch.float32
    torch.testing.assert_close(from_layout(out, layout, n), sdpa(q, k, v, scale=d**-0.5), atol=1e-5, rtol=1e-5)
    assert smax.shape == ssum.shape == (b, n, sq, 8) and smax.dtype == ssum.dtype == torch.float32
    assert sout.numel() == 0 and sout.dtype == q.dtype
    assert (seed, offset, numels) == (0, 0, 0) and all(type(x) is int for x in (seed, offset, numels))


def test_value_head_dim_smaller_than_key():
    q, k = _randn(1, 2, 4, 8, seed=1), _randn(1, 2, 6, 8, seed=2)
    v = _randn(1, 2, 6, 4, seed=3)
    for layout in ("BSH", "BNSD"):
        out, *_ = fa(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), 2, layout)
        expected = expected_attention(q, k, v)
        torch.testing.assert_close(from_layout(out, layout, 2).double(), expected, atol=1e-5, rtol=1e-5)


CAUSAL_RULES = {
    2: lambda sq, skv: (lambda i, j: j <= i),
    3: lambda sq, skv: (lambda i, j: j - i <= skv - sq),
}


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("sq,skv", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_causal_modes(mode, sq, skv, layout):
    b, n, nkv, d = 2, 4, 2, 8
    q, k, v = _randn(b, n, sq, d, seed=4), _randn(b, nkv, skv, d, seed=5), _randn(b, nkv, skv, d, seed=6)
    keep = keep_mask(sq, skv, CAUSAL_RULES[mode](sq, skv))
    out, *_ = fa(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), n, layout,
                 atten_mask=COMPRESSED, sparse_mode=mode, scale=0.3)
    out = from_layout(out, layout, n)
    live = keep.any(-1)
    torch.testing.assert_close(out[:, :, live], sdpa(q, k, v, keep, scale=0.3)[:, :, live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), expected_attention(q, k, v, keep, scale=0.3), atol=1e-5, rtol=1e-5)
    # Rows with no visible key (rightDownCausal, Sq > Skv) are exactly 0.
    assert torch.all(out[:, :, ~live] == 0)


@pytest.mark.parametrize("sq,skv,pre,nxt", [(6, 6, 2, 1), (4, 7, 1, 0), (7, 4, 3, -1), (5, 5, 0, 0)])
def test_band_mode4_right_down(sq, skv, pre, nxt):
    q, k, v = _randn(1, 2, sq, 8, seed=7), _randn(1, 2, skv, 8, seed=8), _randn(1, 2, skv, 8, seed=9)
    # Band counted from the bottom-right corner: diagonal offset (j - i) - (skv - sq).
    keep = keep_mask(sq, skv, lambda i, j: -pre <= (j - i) - (skv - sq) <= nxt)
    out, *_ = fa(q, k, v, 2, "BNSD", atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=pre, next_tockens=nxt)
    torch.testing.assert_close(out.double(), expected_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq,skv,pre,nxt", [(6, 6, 2, 1), (4, 7, 1, 0), (5, 8, 9, -3), (6, 6, -2, 4)])
def test_mode0_band_left_up(sq, skv, pre, nxt):
    q, k, v = _randn(1, 2, sq, 8, seed=10), _randn(1, 2, skv, 8, seed=11), _randn(1, 2, skv, 8, seed=12)
    # The docs' own example mask for mode 0: triu(k=next+1) + tril(k=-pre-1).
    ones = torch.ones(sq, skv)
    masked = (torch.triu(ones, diagonal=nxt + 1) + torch.tril(ones, diagonal=-pre - 1)).bool()
    keep = keep_mask(sq, skv, lambda i, j: -pre <= j - i <= nxt)
    assert torch.equal(keep, ~masked)
    # Band given both ways (mask and tockens) as the docs ask, and by the tockens alone on top
    # of an all-False mask: the tockens must mask on their own.
    for mask in (masked, torch.zeros(sq, skv, dtype=torch.bool)):
        out, *_ = fa(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=0, pre_tockens=pre, next_tockens=nxt)
        torch.testing.assert_close(out.double(), expected_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_shape", ["SS", "11SS", "B1SS", "BNSS"])
@pytest.mark.parametrize("mode", [0, 1])
def test_explicit_masks_modes_0_1(mask_shape, mode):
    b, n, sq, skv = 2, 2, 5, 6
    q, k, v = _randn(b, n, sq, 8, seed=13), _randn(b, n, skv, 8, seed=14), _randn(b, n, skv, 8, seed=15)
    shape = {"SS": (sq, skv), "11SS": (1, 1, sq, skv), "B1SS": (b, 1, sq, skv), "BNSS": (b, n, sq, skv)}[mask_shape]
    masked = torch.rand(shape, generator=_gen(16)) < 0.4
    out, *_ = fa(q, k, v, n, "BNSD", atten_mask=masked.to(torch.uint8), sparse_mode=mode)
    keep = ~masked.reshape((1, 1, sq, skv) if mask_shape == "SS" else shape)
    torch.testing.assert_close(out.double(), expected_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


def test_atten_mask_none_means_full_attention():
    # Docs: with atten_mask None, sparse_mode / pre_tockens / next_tockens have no effect.
    q, k, v = _randn(1, 2, 4, 8, seed=17), _randn(1, 2, 4, 8, seed=18), _randn(1, 2, 4, 8, seed=19)
    with pytest.warns(UserWarning, match="atten_mask=None"):
        out, *_ = fa(q, k, v, 2, "BNSD", sparse_mode=3)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    out, *_ = fa(q, k, v, 2, "BNSD", pre_tockens=0, next_tockens=0)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mask_is_validated(mode):
    q = _randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="compressed atten_mask of shape"):
        fa(q, q, q, 1, "BNSD", atten_mask=COMPRESSED[:4, :4], sparse_mode=mode)
    with pytest.raises(ValueError, match="different contents"):
        fa(q, q, q, 1, "BNSD", atten_mask=torch.tril(torch.ones(2048, 2048)).bool(), sparse_mode=mode)
    # uint8 and a leading (1, 1) are accepted.
    fa(q, q, q, 1, "BNSD", atten_mask=COMPRESSED.to(torch.uint8).reshape(1, 1, 2048, 2048), sparse_mode=mode)


def test_pse_added_before_scale():
    b, n, sq, skv = 2, 3, 4, 5
    q, k, v = _randn(b, n, sq, 8, seed=20), _randn(b, n, skv, 8, seed=21), _randn(b, n, skv, 8, seed=22)
    for shape in ((b, n, sq, skv), (b, n, 1, skv), (1, n, sq, skv)):
        pse = _randn(*shape, seed=23)
        out, *_ = fa(q, k, v, n, "BNSD", pse=pse, scale=0.25)
        # Docs formula: softmax(scale * (pse + q k^T)).
        torch.testing.assert_close(out.double(), expected_attention(q, k, v, scale=0.25, pse=pse), atol=1e-5, rtol=1e-5)


def test_softmax_max_and_sum_give_logsumexp():
    b, n, sq, skv = 1, 2, 4, 6
    q, k, v = _randn(b, n, sq, 8, seed=24), _randn(b, n, skv, 8, seed=25), _randn(b, n, skv, 8, seed=26)
    keep = keep_mask(sq, skv, lambda i, j: j - i <= skv - sq)
    _, smax, ssum, *_ = fa(q, k, v, n, "BNSD", atten_mask=COMPRESSED, sparse_mode=3, scale=0.5)
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.5).masked_fill(~keep, float("-inf"))
    assert torch.all(smax == smax[..., :1]) and torch.all(ssum == ssum[..., :1])
    torch.testing.assert_close(smax[..., 0].double(), scores.amax(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((smax[..., 0] + ssum[..., 0].log()).double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    assert not smax.requires_grad


def test_fully_masked_rows_are_zero_without_nan():
    sq, skv = 6, 3
    q = _randn(1, 2, sq, 8, seed=27, requires_grad=True)
    k = _randn(1, 2, skv, 8, seed=28, requires_grad=True)
    v = _randn(1, 2, skv, 8, seed=29, requires_grad=True)
    out, smax, ssum, *_ = fa(q, k, v, 2, "BNSD", atten_mask=COMPRESSED, sparse_mode=3)
    dead = slice(0, sq - skv)
    assert torch.all(out[:, :, dead] == 0) and torch.all(smax[:, :, dead] == 0) and torch.all(ssum[:, :, dead] == 0)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, dead] == 0)


@pytest.mark.parametrize("layout,mode", [("BSND", 3), ("SBH", 2), ("BNSD", 0)])
def test_gradients_match_sdpa(layout, mode):
    b, n, nkv, sq, skv, d = 2, 4, 2, 5, 7, 8
    base = [_randn(b, n, sq, d, seed=30), _randn(b, nkv, skv, d, seed=31), _randn(b, nkv, skv, d, seed=32)]
    if mode == 0:
        masked = torch.rand(sq, skv, generator=_gen(33)) < 0.3
        masked[:, 0] = False
        keep, kw = ~masked, dict(atten_mask=masked, sparse_mode=0)
    else:
        keep, kw = keep_mask(sq, skv, CAUSAL_RULES[mode](sq, skv)), dict(atten_mask=COMPRESSED, sparse_mode=mode)
    grad_out = _randn(b, n, sq, d, seed=34)

    mine = [to_layout(t, layout).detach().clone().requires_grad_(True) for t in base]
    out, *_ = fa(*mine, n, layout, scale=d**-0.5, **kw)
    (from_layout(out, layout, n) * grad_out).sum().backward()

    theirs = [t.detach().clone().requires_grad_(True) for t in base]
    (sdpa(*theirs, keep=keep, scale=d**-0.5) * grad_out).sum().backward()
    for m, t, heads in zip(mine, theirs, (n, nkv, nkv)):
        torch.testing.assert_close(from_layout(m.grad, layout, heads), t.grad, atol=1e-5, rtol=1e-5)


def test_bf16_computed_in_fp32_and_cast_back():
    q, k, v = (_randn(2, 4, 16, 32, seed=s, dtype=torch.bfloat16) for s in (35, 36, 37))
    out, smax, ssum, sout, *_ = fa(q, k, v, 4, "BNSD", atten_mask=COMPRESSED, sparse_mode=2, scale=32**-0.5)
    assert out.dtype == torch.bfloat16 and smax.dtype == ssum.dtype == torch.float32 and sout.dtype == torch.bfloat16
    keep = keep_mask(16, 16, lambda i, j: j <= i)
    expected = expected_attention(q, k, v, keep, scale=32**-0.5)
    # One bf16 rounding of an fp32 result: well inside bf16's ~4e-3 relative step.
    torch.testing.assert_close(out.double(), expected, atol=8e-3, rtol=8e-3)


# ---- TND (varlen) --------------------------------------------------------------------


def tnd_expected(q_TND, k_TND, v_TND, q_lens, kv_lens, rule_for, scale=1.0):
    """Per-sequence loop through SDPA with an explicit keep mask from rule_for(idx, sq, skv)."""
    outs = []
    qs = ks = 0
    for idx, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        if lq:
            q = q_TND[qs : qs + lq].transpose(0, 1).unsqueeze(0)
            k = k_TND[ks : ks + lk].transpose(0, 1).unsqueeze(0)
            v = v_TND[ks : ks + lk].transpose(0, 1).unsqueeze(0)
            rule = rule_for(idx, lq, lk)
            keep = None if rule is None else keep_mask(lq, lk, rule)
            outs.append(expected_attention(q, k, v, keep, scale=scale)[0].transpose(0, 1))
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs)


def cumsum(lens):
    out, total = [], 0
    for x in lens:
        total += x
        out.append(total)
    return out


@pytest.mark.parametrize(
    "mode,q_lens,kv_lens",
    [
        (3, [3, 1, 4], [3, 1, 4]),
        (3, [2, 3], [4, 3]),
        (2, [2, 4, 1], [3, 2, 1]),
        (4, [5, 3], [6, 3]),
        (1, [3, 4], [4, 2]),
    ],
)
def test_tnd_per_sequence(mode, q_lens, kv_lens):
    n, nkv, d = 4, 2, 8
    q = _randn(sum(q_lens), n, d, seed=40)
    k, v = _randn(sum(kv_lens), nkv, d, seed=41), _randn(sum(kv_lens), nkv, d, seed=42)
    pre, nxt = 2, 0
    if mode == 1:
        masked = torch.rand(max(q_lens), max(kv_lens), generator=_gen(43)) < 0.3
        masked[:, 0] = False
        mask = masked
        rule_for = lambda idx, sq, skv: (lambda i, j: not masked[i, j])  # noqa: E731
    else:
        mask = COMPRESSED
        rule_for = {
            2: lambda idx, sq, skv: (lambda i, j: j <= i),
            3: lambda idx, sq, skv: (lambda i, j: j - i <= skv - sq),
            4: lambda idx, sq, skv: (lambda i, j: -pre <= (j - i) - (skv - sq) <= nxt),
        }[mode]
    out, smax, ssum, *_ = fa(q, k, v, n, "TND", atten_mask=mask, sparse_mode=mode, pre_tockens=pre, next_tockens=nxt,
                             actual_seq_qlen=cumsum(q_lens), actual_seq_kvlen=cumsum(kv_lens), scale=0.4)
    assert out.shape == (sum(q_lens), n, d) and smax.shape == ssum.shape == (sum(q_lens), n, 8)
    expected = tnd_expected(q, k, v, q_lens, kv_lens, rule_for, 0.4)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_tnd_zero_length_and_skipped_tail():
    # Lengths [2, 0, 3] then two batches skipped with trailing zeros ("[2, 5, 9, 0, 0]" in the docs);
    # the query holds 2 extra tokens no sequence claims: they come out as 0.
    n, d = 2, 8
    q, k, v = _randn(7, n, d, seed=44), _randn(5, n, d, seed=45), _randn(5, n, d, seed=46)
    out, *_ = fa(q, k, v, n, "TND", atten_mask=COMPRESSED, sparse_mode=3,
                 actual_seq_qlen=[2, 2, 5, 0, 0], actual_seq_kvlen=[2, 2, 5, 0, 0])
    expected = tnd_expected(q, k, v, [2, 0, 3], [2, 0, 3], lambda idx, sq, skv: (lambda i, j: j <= i))
    torch.testing.assert_close(out[:5].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.all(out[5:] == 0)


def test_tnd_gradients_match_per_sequence_sdpa():
    q_lens, n, d = [3, 5, 2], 2, 8
    base = [_randn(10, n, d, seed=s) for s in (47, 48, 49)]
    grad_out = _randn(10, n, d, seed=50)
    mine = [t.clone().requires_grad_(True) for t in base]
    out, *_ = fa(*mine, n, "TND", atten_mask=COMPRESSED, sparse_mode=3, actual_seq_qlen=cumsum(q_lens),
                 actual_seq_kvlen=cumsum(q_lens), scale=0.3)
    (out * grad_out).sum().backward()
    theirs = [t.clone().requires_grad_(True) for t in base]
    pieces, start = [], 0
    for ln in q_lens:
        q, k, v = (t[start : start + ln].transpose(0, 1).unsqueeze(0) for t in theirs)
        pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)[0].transpose(0, 1))
        start += ln
    (torch.cat(pieces) * grad_out).sum().backward()
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m.grad, t.grad, atol=1e-5, rtol=1e-5)


def test_tnd_softmax_layout():
    q_lens, n = [2, 3], 3
    q = _randn(5, n, 4, seed=51)
    lse = []
    for qs, ln in ((0, 2), (2, 3)):
        s = q[qs : qs + ln].transpose(0, 1) @ q[qs : qs + ln].transpose(0, 1).transpose(-1, -2)
        lse.append(s.logsumexp(-1))  # (N, S)
    lse_NT = torch.cat(lse, dim=1)
    kw = dict(actual_seq_qlen=cumsum(q_lens), actual_seq_kvlen=cumsum(q_lens))
    _, smax, ssum, *_ = fa(q, q, q, n, "TND", softmax_layout="TND", **kw)
    assert smax.shape == (5, n, 8)
    torch.testing.assert_close(smax[..., 0] + ssum[..., 0].log(), lse_NT.t(), atol=1e-5, rtol=1e-5)
    # Default: NTD order in the same (T, N, 8) buffer.
    _, smax, ssum, *_ = fa(q, q, q, n, "TND", **kw)
    assert smax.shape == (5, n, 8)
    torch.testing.assert_close((smax[..., 0] + ssum[..., 0].log()).flatten(), lse_NT.flatten(), atol=1e-5, rtol=1e-5)


# ---- prefix (5, 6) and varlen split-across-cards (7, 8) ------------------------------


def test_prefix_modes_5_and_6():
    b, n, sq, skv = 2, 2, 4, 6
    q, k, v = _randn(b, n, sq, 8, seed=52), _randn(b, n, skv, 8, seed=53), _randn(b, n, skv, 8, seed=54)
    prefix = [3, 5]
    # Docs: rightDownCausal plus a block of width prefix[b] on the left.
    keep = torch.stack([keep_mask(sq, skv, lambda i, j, p=p: j - i <= skv - sq or j < p) for p in prefix]).unsqueeze(1)
    expected = expected_attention(q, k, v, keep)
    out5, *_ = fa(q, k, v, n, "BNSD", atten_mask=~keep, sparse_mode=5, prefix=prefix)
    torch.testing.assert_close(out5.double(), expected, atol=1e-5, rtol=1e-5)
    rect = torch.cat([torch.zeros(1024, 1024), torch.ones(1024, 1024)], dim=1)
    mask6 = torch.cat([COMPRESSED.float(), rect]).bool()
    out6, *_ = fa(q, k, v, n, "BNSD", atten_mask=mask6, sparse_mode=6, prefix=prefix)
    torch.testing.assert_close(out6.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prefix"):
        fa(q, k, v, n, "BNSD", atten_mask=mask6, sparse_mode=6)


def test_mode7_matches_doc_split_of_right_down_causal():
    # Docs, sparse_mode 7: a 4x6 rightDownCausal sequence cut after 2 query rows; card 1 holds
    # a 3x3 causal sequence plus the first 2 rows, actual_seq_qlen {3,5}, kvlen {3,9},
    # pre_tockens=6, next_tockens=-2.
    n, d = 2, 8
    qa, ka, va = _randn(3, n, d, seed=55), _randn(3, n, d, seed=56), _randn(3, n, d, seed=57)
    qb, kb, vb = _randn(4, n, d, seed=58), _randn(6, n, d, seed=59), _randn(6, n, d, seed=60)
    out, *_ = fa(torch.cat([qa, qb[:2]]), torch.cat([ka, kb]), torch.cat([va, vb]), n, "TND", atten_mask=COMPRESSED,
                 sparse_mode=7, pre_tockens=6, next_tockens=-2, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9])
    full_b = tnd_expected(qb, kb, vb, [4], [6], lambda idx, sq, skv: (lambda i, j: j - i <= skv - sq))
    full_a = tnd_expected(qa, ka, va, [3], [3], lambda idx, sq, skv: (lambda i, j: j <= i))
    torch.testing.assert_close(out.double(), torch.cat([full_a, full_b[:2]]), atol=1e-5, rtol=1e-5)
    # Card 2 keeps mode 3 for the last 2 rows.
    out2, *_ = fa(qb[2:], kb, vb, n, "TND", atten_mask=COMPRESSED, sparse_mode=3,
                  actual_seq_qlen=[2], actual_seq_kvlen=[6])
    torch.testing.assert_close(out2.double(), full_b[2:], atol=1e-5, rtol=1e-5)


def test_mode8_matches_doc_split_of_left_up_causal():
    # Docs, sparse_mode 8: a 5x4 leftUpCausal sequence cut after 2 query rows; card 2 holds the
    # last 3 rows then two more sequences, qlen {3,8,12}, kvlen {4,9,13}, pre=4, next=1.
    n, d = 2, 8
    qa, ka, va = _randn(5, n, d, seed=61), _randn(4, n, d, seed=62), _randn(4, n, d, seed=63)
    qb, kb, vb = _randn(5, n, d, seed=64), _randn(5, n, d, seed=65), _randn(5, n, d, seed=66)
    qc, kc, vc = _randn(4, n, d, seed=67), _randn(4, n, d, seed=68), _randn(4, n, d, seed=69)
    out, *_ = fa(torch.cat([qa[2:], qb, qc]), torch.cat([ka, kb, kc]), torch.cat([va, vb, vc]), n, "TND",
                 atten_mask=COMPRESSED, sparse_mode=8, pre_tockens=4, next_tockens=1,
                 actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13])
    causal = lambda idx, sq, skv: (lambda i, j: j <= i)  # noqa: E731
    full_a = tnd_expected(qa, ka, va, [5], [4], causal)
    expected = torch.cat([full_a[2:], tnd_expected(torch.cat([qb, qc]), torch.cat([kb, kc]), torch.cat([vb, vc]),
                                                   [5, 4], [5, 4], causal)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# ---- argument errors -------------------------------------------------------------------


def test_fusion_attention_errors():
    q = _randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="input_layout='XYZ'.*BSH, SBH, BSND, BNSD, TND"):
        fa(q, q, q, 2, "XYZ")
    with pytest.raises(NotImplementedError, match="keep_prob"):
        fa(q, q, q, 2, "BNSD", keep_prob=0.9)
    with pytest.raises(ValueError, match="head_num=3"):
        fa(q, q, q, 3, "BNSD")
    with pytest.raises(ValueError, match="sparse_mode=7"):
        fa(q, q, q, 2, "BNSD", atten_mask=COMPRESSED, sparse_mode=7)
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        fa(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), 2, "TND")
    with pytest.raises(ValueError, match="softmax_layout"):
        fa(q, q, q, 2, "BNSD", softmax_layout="TND")
    with pytest.raises(ValueError, match="padding_mask"):
        fa(q, q, q, 2, "BNSD", padding_mask=q)
    with pytest.raises(ValueError, match="atten_mask dtype"):
        fa(q, q, q, 2, "BNSD", atten_mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="multiple"):
        fa(q, _randn(1, 3, 4, 8), _randn(1, 3, 4, 8), 2, "BNSD")


# --------------------------------------------------------------------------------------
# npu_grouped_matmul
# --------------------------------------------------------------------------------------


def loop_gmm(x_MK, w_EKN, counts, bias_EN=None):
    rows, start = [], 0
    for e, c in enumerate(counts):
        y = x_MK[start : start + c].double() @ w_EKN[e].double()
        if bias_EN is not None:
            y = y + bias_EN[e].double()
        rows.append(y)
        start += c
    return torch.cat(rows)


@pytest.mark.parametrize("counts", [[3, 0, 5, 0, 2], [0, 0, 4], [7], [1, 2, 3, 4, 5, 6, 7]])
@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("split_item", [2, 3])
def test_gmm_moe_path(counts, group_list_type, split_item):
    m, k, n = sum(counts), 6, 5
    x, w = _randn(m, k, seed=70), _randn(len(counts), k, n, seed=71)
    group_list = torch.tensor(cumsum(counts) if group_list_type == 0 else counts, dtype=torch.int64)
    (y,) = ref.npu_grouped_matmul([x], [w], group_list=group_list, split_item=split_item, group_type=0,
                                  group_list_type=group_list_type)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), loop_gmm(x, w, counts), atol=1e-5, rtol=1e-5)


def test_gmm_gradients_match_loop():
    counts = [4, 0, 3, 5, 1]
    m, k, n = sum(counts), 6, 4
    x0, w0, g = _randn(m, k, seed=72), _randn(5, k, n, seed=73), _randn(m, n, seed=74)
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (y,) = ref.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor(counts), split_item=3, group_type=0, group_list_type=1
    )
    (y * g).sum().backward()
    xr, wr = x0.double().requires_grad_(True), w0.double().requires_grad_(True)
    (loop_gmm(xr, wr, counts) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=1e-5, rtol=1e-5)
    assert torch.all(w.grad[1] == 0)  # the empty group gets no gradient


def test_gmm_bf16_accumulates_in_fp32():
    counts = [5, 3]
    x, w = _randn(8, 64, seed=75, dtype=torch.bfloat16), _randn(2, 64, 16, seed=76, dtype=torch.bfloat16)
    (y,) = ref.npu_grouped_matmul([x], [w], group_list=torch.tensor(cumsum(counts)), split_item=3, group_type=0)
    assert y.dtype == torch.bfloat16
    # Exact fp32 accumulation rounded once to bf16.
    torch.testing.assert_close(y, loop_gmm(x, w, counts).float().bfloat16(), atol=0, rtol=0)


def test_gmm_list_group_list_and_weight_list():
    counts = [2, 3, 0, 4]
    x, w = _randn(9, 5, seed=77), _randn(4, 5, 3, seed=78)
    bias = _randn(4, 3, seed=79)
    # 单多单: weight as a list of 2-D matrices, group_list a list of cumulative offsets.
    (y,) = ref.npu_grouped_matmul([x], list(w), bias=list(bias), group_list=cumsum(counts), split_item=2)
    torch.testing.assert_close(y.double(), loop_gmm(x, w, counts, bias), atol=1e-5, rtol=1e-5)
    # 单多多: one output per group.
    ys = ref.npu_grouped_matmul([x], list(w), group_list=cumsum(counts), split_item=0)
    assert [t.shape[0] for t in ys] == counts
    torch.testing.assert_close(torch.cat(ys).double(), loop_gmm(x, w, counts), atol=1e-5, rtol=1e-5)
    # A 3-D weight takes its bias as one (E, N) tensor.
    (y,) = ref.npu_grouped_matmul(
        [x], [w], bias=[bias], group_list=torch.tensor(cumsum(counts)), split_item=3, group_type=0
    )
    torch.testing.assert_close(y.double(), loop_gmm(x, w, counts, bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="always cumulative"):
        ref.npu_grouped_matmul([x], list(w), group_list=counts, split_item=2, group_list_type=1)


def test_gmm_multi_x_multi_weight():
    xs = [_randn(2, 3, 4, seed=80), _randn(5, 4, seed=81), _randn(1, 6, seed=82)]
    ws = [_randn(4, 2, seed=83), _randn(4, 3, seed=84), _randn(6, 2, seed=85)]
    bs = [_randn(2, seed=86), _randn(3, seed=87), _randn(2, seed=88)]
    ys = ref.npu_grouped_matmul(xs, ws, bias=bs, group_type=-1)
    for y, x, w, b in zip(ys, xs, ws, bs):
        torch.testing.assert_close(y.double(), x.double() @ w.double() + b.double(), atol=1e-5, rtol=1e-5)
    # 多多单: 2-D xs concatenated into one output (weights share N).
    xs2, ws2 = [_randn(2, 4, seed=89), _randn(3, 4, seed=90)], [_randn(4, 3, seed=91), _randn(4, 3, seed=92)]
    (y,) = ref.npu_grouped_matmul(xs2, ws2, split_item=2)
    expected = torch.cat([a.double() @ b.double() for a, b in zip(xs2, ws2)])
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def test_gmm_uncovered_tail_rows_are_zero():
    x, w = _randn(10, 4, seed=93), _randn(2, 4, 3, seed=94)
    (y,) = ref.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([3, 4]), split_item=3, group_type=0, group_list_type=1
    )
    torch.testing.assert_close(y[:7].double(), loop_gmm(x, w, [3, 4]), atol=1e-5, rtol=1e-5)
    assert torch.all(y[7:] == 0)


@pytest.mark.parametrize(
    "kwarg", ["scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale", "activation_input",
              "activation_quant_scale", "activation_quant_offset"],
)
def test_gmm_quant_args_not_implemented(kwarg):
    x, w = _randn(4, 4), _randn(1, 4, 4)
    with pytest.raises(NotImplementedError, match=kwarg):
        ref.npu_grouped_matmul([x], [w], group_list=torch.tensor([4]), split_item=3, group_type=0, **{kwarg: [x]})


def test_gmm_errors():
    x, w = _randn(6, 4), _randn(2, 4, 3)
    gl = torch.tensor([2, 6])
    with pytest.raises(ValueError, match="group_type=0"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3)
    with pytest.raises(ValueError, match="split_item=2 or 3"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=0, group_type=0)
    with pytest.raises(ValueError, match="covers 9 rows"):
        ref.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 5]), split_item=3, group_type=0, group_list_type=1)
    with pytest.raises(ValueError, match="non-decreasing"):
        ref.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 2]), split_item=3, group_type=0)
    with pytest.raises(ValueError, match="output_dtype"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, output_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="list of tensors"):
        ref.npu_grouped_matmul(x, [w], group_list=gl, split_item=3, group_type=0)
    with pytest.raises(NotImplementedError, match="act_type"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, act_type=1)
    # output_dtype restating x's dtype is fine, as a torch.dtype or an at::ScalarType code.
    for od in (torch.float32, 6):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, output_dtype=od)


# --------------------------------------------------------------------------------------
# npu_moe_token_permute / npu_moe_token_unpermute
# --------------------------------------------------------------------------------------


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
    tokens = _randn(num_tokens, hidden, seed=95)
    indices = torch.stack([torch.randperm(experts, generator=_gen(96 + t))[:topk] for t in range(num_tokens)])
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
    probs = torch.rand(num_tokens, topk, generator=_gen(97))
    out = ref.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    torch.testing.assert_close(out, tokens * probs.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)


def test_permute_unpermute_gradcheck():
    tokens = torch.randn(4, 3, dtype=torch.float64, generator=_gen(98), requires_grad=True)
    indices = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 2]])
    assert torch.autograd.gradcheck(lambda t: ref.npu_moe_token_permute(t, indices)[0], (tokens,))
    assert torch.autograd.gradcheck(lambda t: ref.npu_moe_token_permute(t, indices, 5)[0], (tokens,))
    _, sorted_indices = ref.npu_moe_token_permute(tokens.detach(), indices)
    permuted = torch.randn(8, 3, dtype=torch.float64, generator=_gen(99), requires_grad=True)
    probs = torch.rand(4, 2, dtype=torch.float64, generator=_gen(100), requires_grad=True)
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
    tokens = _randn(4, 8, seed=101, dtype=torch.bfloat16)
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
