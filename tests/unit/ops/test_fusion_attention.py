"""npu_inject.ops.reference.npu_fusion_attention against independent math.

Expected values come from explicit loops, hand computation and torch's own
scaled_dot_product_attention (whose attn_mask is True = KEEP, the opposite of torch_npu's
atten_mask); the reference is never compared with itself. The modes npu_inject calls
(BSND/TND, sparse_mode 0 unmasked, 2, 3, 4 with pre_tockens = window - 1) and the ones it
keeps because they are the kernel's base semantics (BNSD, explicit masks of modes 0/1)
are covered; the documented arguments it does not implement must raise.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernelkit import NODEF, POS, cumsum, generator, randn
from npu_inject.ops import reference as ref
from npu_inject.ops.reference import fusion_attention as fusion_attention_module

COMPRESSED = torch.triu(torch.ones(2048, 2048), diagonal=1).bool()


# _op_plugin_docs.py, "npu_fusion_attention", 接口原型.
DOCUMENTED_SIGNATURE = [
    ("query", POS, NODEF), ("key", POS, NODEF), ("value", POS, NODEF), ("head_num", POS, NODEF),
    ("input_layout", POS, NODEF), ("pse", POS, None), ("padding_mask", POS, None), ("atten_mask", POS, None),
    ("scale", POS, 1.0), ("keep_prob", POS, 1.0), ("pre_tockens", POS, 2147483647),
    ("next_tockens", POS, 2147483647), ("inner_precise", POS, 0), ("prefix", POS, None),
    ("actual_seq_qlen", POS, None), ("actual_seq_kvlen", POS, None), ("sparse_mode", POS, 0),
    ("gen_mask_parallel", POS, True), ("sync", POS, False), ("softmax_layout", POS, ""),
    # The prototype stops there; torch_npu 2.14.0's schema (npu_native_functions_by_codegen.yaml) goes on
    # with sink, then dropout_mask, seed and offset, which npu_inject does not pass.
    ("sink", POS, None),
]


def test_signature_matches_docs():
    parameters = inspect.signature(ref.npu_fusion_attention).parameters.values()
    assert [(p.name, p.kind, p.default) for p in parameters] == DOCUMENTED_SIGNATURE


def keep_mask(sq, skv, rule):
    """Boolean (Sq, Skv), True = keep, built element by element from a rule(i, j)."""
    return torch.tensor([[bool(rule(i, j)) for j in range(skv)] for i in range(sq)])


def expected_attention(q_BNSD, k_BKSD, v_BKSD, keep=None, scale=1.0):
    """float64 softmax(scale * q k^T) v with repeat_interleave'd KV; empty rows -> 0."""
    n, nkv = q_BNSD.shape[1], k_BKSD.shape[1]
    q = q_BNSD.double()
    k = k_BKSD.double().repeat_interleave(n // nkv, dim=1)
    v = v_BKSD.double().repeat_interleave(n // nkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
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
    return {"BNSD": t_BNSD, "BSND": t_BNSD.transpose(1, 2)}[layout]


def from_layout(t, layout, n):
    return {"BNSD": t, "BSND": t.transpose(1, 2)}[layout]


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


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
@pytest.mark.parametrize("nkv", [4, 2, 1])
def test_layouts_and_gqa_match_sdpa(layout, nkv):
    b, n, sq, skv, d = 2, 4, 5, 7, 8
    q = randn(b, n, sq, d, seed=1)
    k = randn(b, nkv, skv, d, seed=2)
    v = randn(b, nkv, skv, d, seed=3)
    out, smax, ssum, sout, seed, offset, numels = fa(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), n, layout, scale=d**-0.5
    )
    assert out.shape == to_layout(q, layout).shape and out.dtype == torch.float32
    torch.testing.assert_close(from_layout(out, layout, n), sdpa(q, k, v, scale=d**-0.5), atol=1e-5, rtol=1e-5)
    assert smax.shape == ssum.shape == (b, n, sq, 8) and smax.dtype == ssum.dtype == torch.float32
    assert sout.numel() == 0 and sout.dtype == q.dtype
    assert (seed, offset, numels) == (0, 0, 0) and all(type(x) is int for x in (seed, offset, numels))


def test_value_head_dim_smaller_than_key():
    q, k = randn(1, 2, 4, 8, seed=1), randn(1, 2, 6, 8, seed=2)
    v = randn(1, 2, 6, 4, seed=3)
    for layout in ("BSND", "BNSD"):
        out, *_ = fa(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), 2, layout)
        expected = expected_attention(q, k, v)
        torch.testing.assert_close(from_layout(out, layout, 2).double(), expected, atol=1e-5, rtol=1e-5)


CAUSAL_RULES = {
    2: lambda sq, skv: (lambda i, j: j <= i),
    3: lambda sq, skv: (lambda i, j: j - i <= skv - sq),
}


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("sq,skv", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
def test_causal_modes(mode, sq, skv, layout):
    b, n, nkv, d = 2, 4, 2, 8
    q, k, v = randn(b, n, sq, d, seed=4), randn(b, nkv, skv, d, seed=5), randn(b, nkv, skv, d, seed=6)
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
    q, k, v = randn(1, 2, sq, 8, seed=7), randn(1, 2, skv, 8, seed=8), randn(1, 2, skv, 8, seed=9)
    # Band counted from the bottom-right corner: diagonal offset (j - i) - (skv - sq).
    keep = keep_mask(sq, skv, lambda i, j: -pre <= (j - i) - (skv - sq) <= nxt)
    out, *_ = fa(q, k, v, 2, "BNSD", atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=pre, next_tockens=nxt)
    torch.testing.assert_close(out.double(), expected_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq,skv,pre,nxt", [(6, 6, 2, 1), (4, 7, 1, 0), (5, 8, 9, -3), (6, 6, -2, 4)])
def test_mode0_band_left_up(sq, skv, pre, nxt):
    q, k, v = randn(1, 2, sq, 8, seed=10), randn(1, 2, skv, 8, seed=11), randn(1, 2, skv, 8, seed=12)
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
    q, k, v = randn(b, n, sq, 8, seed=13), randn(b, n, skv, 8, seed=14), randn(b, n, skv, 8, seed=15)
    shape = {"SS": (sq, skv), "11SS": (1, 1, sq, skv), "B1SS": (b, 1, sq, skv), "BNSS": (b, n, sq, skv)}[mask_shape]
    masked = torch.rand(shape, generator=generator(16)) < 0.4
    out, *_ = fa(q, k, v, n, "BNSD", atten_mask=masked.to(torch.uint8), sparse_mode=mode)
    keep = ~masked.reshape((1, 1, sq, skv) if mask_shape == "SS" else shape)
    torch.testing.assert_close(out.double(), expected_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


def test_atten_mask_none_means_full_attention():
    # Docs: with atten_mask None, sparse_mode / pre_tockens / next_tockens have no effect.
    q, k, v = randn(1, 2, 4, 8, seed=17), randn(1, 2, 4, 8, seed=18), randn(1, 2, 4, 8, seed=19)
    with pytest.warns(UserWarning, match="atten_mask=None"):
        out, *_ = fa(q, k, v, 2, "BNSD", sparse_mode=3)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    out, *_ = fa(q, k, v, 2, "BNSD", pre_tockens=0, next_tockens=0)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mask_is_validated(mode):
    q = randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="compressed atten_mask of shape"):
        fa(q, q, q, 1, "BNSD", atten_mask=COMPRESSED[:4, :4], sparse_mode=mode)
    with pytest.raises(ValueError, match="different contents"):
        fa(q, q, q, 1, "BNSD", atten_mask=torch.tril(torch.ones(2048, 2048)).bool(), sparse_mode=mode)
    # uint8 and a leading (1, 1) are accepted.
    fa(q, q, q, 1, "BNSD", atten_mask=COMPRESSED.to(torch.uint8).reshape(1, 1, 2048, 2048), sparse_mode=mode)


def test_softmax_max_and_sum_give_logsumexp():
    b, n, sq, skv = 1, 2, 4, 6
    q, k, v = randn(b, n, sq, 8, seed=24), randn(b, n, skv, 8, seed=25), randn(b, n, skv, 8, seed=26)
    keep = keep_mask(sq, skv, lambda i, j: j - i <= skv - sq)
    _, smax, ssum, *_ = fa(q, k, v, n, "BNSD", atten_mask=COMPRESSED, sparse_mode=3, scale=0.5)
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.5).masked_fill(~keep, float("-inf"))
    assert torch.all(smax == smax[..., :1]) and torch.all(ssum == ssum[..., :1])
    torch.testing.assert_close(smax[..., 0].double(), scores.amax(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((smax[..., 0] + ssum[..., 0].log()).double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    assert not smax.requires_grad


def test_fully_masked_rows_are_zero_without_nan():
    sq, skv = 6, 3
    q = randn(1, 2, sq, 8, seed=27, requires_grad=True)
    k = randn(1, 2, skv, 8, seed=28, requires_grad=True)
    v = randn(1, 2, skv, 8, seed=29, requires_grad=True)
    out, smax, ssum, *_ = fa(q, k, v, 2, "BNSD", atten_mask=COMPRESSED, sparse_mode=3)
    dead = slice(0, sq - skv)
    assert torch.all(out[:, :, dead] == 0) and torch.all(smax[:, :, dead] == 0) and torch.all(ssum[:, :, dead] == 0)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, dead] == 0)


@pytest.mark.parametrize("layout,mode", [("BSND", 3), ("BNSD", 2), ("BSND", 4), ("BNSD", 0)])
def test_gradients_match_sdpa(layout, mode):
    b, n, nkv, sq, skv, d = 2, 4, 2, 5, 7, 8
    base = [randn(b, n, sq, d, seed=30), randn(b, nkv, skv, d, seed=31), randn(b, nkv, skv, d, seed=32)]
    if mode == 0:
        masked = torch.rand(sq, skv, generator=generator(33)) < 0.3
        masked[:, 0] = False
        keep, kw = ~masked, dict(atten_mask=masked, sparse_mode=0)
    elif mode == 4:
        # The sliding window npu_inject asks for: pre_tockens = window - 1, next_tockens = 0.
        keep = keep_mask(sq, skv, lambda i, j: -2 <= (j - i) - (skv - sq) <= 0)
        kw = dict(atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=2, next_tockens=0)
    else:
        keep, kw = keep_mask(sq, skv, CAUSAL_RULES[mode](sq, skv)), dict(atten_mask=COMPRESSED, sparse_mode=mode)
    grad_out = randn(b, n, sq, d, seed=34)

    mine = [to_layout(t, layout).detach().clone().requires_grad_(True) for t in base]
    out, *_ = fa(*mine, n, layout, scale=d**-0.5, **kw)
    (from_layout(out, layout, n) * grad_out).sum().backward()

    theirs = [t.detach().clone().requires_grad_(True) for t in base]
    (sdpa(*theirs, keep=keep, scale=d**-0.5) * grad_out).sum().backward()
    for m, t, heads in zip(mine, theirs, (n, nkv, nkv)):
        torch.testing.assert_close(from_layout(m.grad, layout, heads), t.grad, atol=1e-5, rtol=1e-5)


def test_bf16_computed_in_fp32_and_cast_back():
    q, k, v = (randn(2, 4, 16, 32, seed=s, dtype=torch.bfloat16) for s in (35, 36, 37))
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
    q = randn(sum(q_lens), n, d, seed=40)
    k, v = randn(sum(kv_lens), nkv, d, seed=41), randn(sum(kv_lens), nkv, d, seed=42)
    pre, nxt = 2, 0
    if mode == 1:
        masked = torch.rand(max(q_lens), max(kv_lens), generator=generator(43)) < 0.3
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
    q, k, v = randn(7, n, d, seed=44), randn(5, n, d, seed=45), randn(5, n, d, seed=46)
    out, *_ = fa(q, k, v, n, "TND", atten_mask=COMPRESSED, sparse_mode=3,
                 actual_seq_qlen=[2, 2, 5, 0, 0], actual_seq_kvlen=[2, 2, 5, 0, 0])
    expected = tnd_expected(q, k, v, [2, 0, 3], [2, 0, 3], lambda idx, sq, skv: (lambda i, j: j <= i))
    torch.testing.assert_close(out[:5].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.all(out[5:] == 0)


def test_tnd_gradients_match_per_sequence_sdpa():
    q_lens, n, d = [3, 5, 2], 2, 8
    base = [randn(10, n, d, seed=s) for s in (47, 48, 49)]
    grad_out = randn(10, n, d, seed=50)
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
    q = randn(5, n, 4, seed=51)
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


# ---- tiles (flash-attention style) ---------------------------------------------------------


def diagonal_keep(sq, skv, lo=None, hi=None):
    """Boolean (Sq, Skv), True = keep j - i within [lo, hi] (None: unbounded), by broadcasting."""
    diagonal = torch.arange(skv).view(1, skv) - torch.arange(sq).view(sq, 1)
    keep = torch.ones(sq, skv, dtype=torch.bool)
    if lo is not None:
        keep &= diagonal >= lo
    if hi is not None:
        keep &= diagonal <= hi
    return keep


def check_against_float64(q, k, v, keep, kw, layout="BNSD", scale=0.125):
    """Forward (out, softmax_max, softmax_max + log softmax_sum) and q/k/v gradients vs float64 math."""
    n = q.shape[1]
    mine = [to_layout(t, layout).detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, smax, ssum, *_ = fa(*mine, n, layout, scale=scale, **kw)
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    expected = expected_attention(*theirs, keep, scale=scale)
    torch.testing.assert_close(from_layout(out, layout, n).double(), expected, atol=2e-5, rtol=2e-5)
    groups = n // k.shape[1]
    s = (theirs[0] @ theirs[1].repeat_interleave(groups, 1).transpose(-1, -2) * scale).detach()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    live = torch.isfinite(s.amax(-1))
    torch.testing.assert_close(smax[..., 0].double(), torch.where(live, s.amax(-1), 0.0), atol=2e-5, rtol=2e-5)
    lse = (smax[..., 0] + ssum[..., 0].log()).double()
    torch.testing.assert_close(lse[live], s.logsumexp(-1)[live], atol=2e-5, rtol=2e-5)
    assert torch.all(ssum[..., 0][~live] == 0)
    grad_out = randn(*expected.shape, seed=99)
    (from_layout(out, layout, n) * grad_out).sum().backward()
    (expected * grad_out.double()).sum().backward()
    for name, m, t, heads in zip("qkv", mine, theirs, (n, k.shape[1], k.shape[1])):
        torch.testing.assert_close(from_layout(m.grad, layout, heads).double(), t.grad, atol=2e-5, rtol=2e-5,
                                   msg=f"d{name}")


# sq, skv, tile: the tile side (64, 100) divides neither length.
LONG_CASES = [(300, 300, 64), (200, 333, 100), (333, 200, 64)]


@pytest.mark.parametrize("sq,skv,tile", LONG_CASES)
@pytest.mark.parametrize("mode", [2, 3, 4, "band0+mask", "mask1", "full"])
def test_tiled_modes_match_float64_math(mode, sq, skv, tile, monkeypatch):
    monkeypatch.setattr(fusion_attention_module, "TILE_SIDE", tile)
    b, n, nkv, d = 1, 4, 2, 16
    q, k, v = randn(b, n, sq, d, seed=60), randn(b, nkv, skv, d, seed=61), randn(b, nkv, skv, d, seed=62)
    if mode == 2:
        keep, kw = diagonal_keep(sq, skv, hi=0), dict(atten_mask=COMPRESSED, sparse_mode=2)
    elif mode == 3:  # sq > skv leaves the first rows with no key
        keep, kw = diagonal_keep(sq, skv, hi=skv - sq), dict(atten_mask=COMPRESSED, sparse_mode=3)
    elif mode == 4:  # a window of 70 tokens, crossing tile boundaries
        keep = diagonal_keep(sq, skv, lo=skv - sq - 69, hi=skv - sq)
        kw = dict(atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=69, next_tockens=0)
    elif mode == "band0+mask":  # explicit BNSS mask plus a left-up band
        masked = torch.rand(b, n, sq, skv, generator=generator(63)) < 0.3
        keep = diagonal_keep(sq, skv, lo=-90, hi=40) & ~masked
        kw = dict(atten_mask=masked, sparse_mode=0, pre_tockens=90, next_tockens=40)
    elif mode == "mask1":  # explicit SS mask with whole rows masked in the middle of a tile
        masked = torch.rand(sq, skv, generator=generator(64)) < 0.5
        masked[70:75] = True
        keep, kw = ~masked, dict(atten_mask=masked, sparse_mode=1)
    else:
        keep, kw = None, {}
    check_against_float64(q, k, v, keep, kw, layout="BSND" if mode in (3, "full") else "BNSD")


def test_default_tiles_on_a_length_they_do_not_divide():
    sq = 1100  # two full default tiles and a partial one
    q, k, v = randn(1, 2, sq, 8, seed=65), randn(1, 1, sq, 8, seed=66), randn(1, 1, sq, 8, seed=67)
    assert sq % fusion_attention_module._tile_side(2) != 0
    check_against_float64(q, k, v, diagonal_keep(sq, sq, hi=0), dict(atten_mask=COMPRESSED, sparse_mode=2),
                          layout="BSND")


def test_tnd_documents_across_tiles(monkeypatch):
    monkeypatch.setattr(fusion_attention_module, "TILE_SIDE", 48)
    q_lens, n, nkv, d = [130, 7, 201], 4, 2, 8
    q, k, v = (randn(sum(q_lens), heads, d, seed=s) for s, heads in ((68, n), (69, nkv), (70, nkv)))
    out, *_ = fa(q, k, v, n, "TND", atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=59, next_tockens=0,
                 actual_seq_qlen=cumsum(q_lens), actual_seq_kvlen=cumsum(q_lens), scale=0.3)
    expected = tnd_expected(q, k, v, q_lens, q_lens, lambda idx, sq, skv: (lambda i, j: -59 <= j - i <= 0), 0.3)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


class LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


@pytest.mark.parametrize("layout,kw", [
    ("BSND", dict(atten_mask=COMPRESSED, sparse_mode=2)),
    ("TND", dict(atten_mask=COMPRESSED, sparse_mode=3)),
    ("BSND", {}),
])
def test_forward_and_backward_never_hold_a_sequence_by_sequence_tensor(layout, kw):
    # The rehearsal's host memory must grow linearly with the sequence: no op in the forward or
    # the backward may produce anything of S x S elements (the compressed 2048 x 2048 mask is an
    # input, and S = 4096 is larger).
    s, n, d = 4096, 2, 8
    shape = (s, n, d) if layout == "TND" else (1, s, n, d)
    q, k, v = (randn(*shape, seed=seed, requires_grad=True) for seed in (71, 72, 73))
    lengths = dict(actual_seq_qlen=[s], actual_seq_kvlen=[s]) if layout == "TND" else {}
    with LargestOutput() as watch:
        out, *_ = fa(q, k, v, n, layout, scale=0.3, **kw, **lengths)
        out.sum().backward()
    assert watch.largest < s * s, f"an op produced {watch.largest} elements, S x S = {s * s}"


# ---- argument errors -------------------------------------------------------------------


def test_fusion_attention_errors():
    q = randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="input_layout='XYZ'.*BSH, SBH, BSND, BNSD, TND"):
        fa(q, q, q, 2, "XYZ")
    with pytest.raises(NotImplementedError, match="keep_prob"):
        fa(q, q, q, 2, "BNSD", keep_prob=0.9)
    with pytest.raises(ValueError, match="head_num=3"):
        fa(q, q, q, 3, "BNSD")
    with pytest.raises(ValueError, match="sparse_mode=9"):
        fa(q, q, q, 2, "BNSD", sparse_mode=9)
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        fa(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), 2, "TND")
    with pytest.raises(ValueError, match="softmax_layout"):
        fa(q, q, q, 2, "BNSD", softmax_layout="TND")
    with pytest.raises(ValueError, match="padding_mask"):
        fa(q, q, q, 2, "BNSD", padding_mask=q)
    with pytest.raises(ValueError, match="atten_mask dtype"):
        fa(q, q, q, 2, "BNSD", atten_mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="multiple"):
        fa(q, randn(1, 3, 4, 8), randn(1, 3, 4, 8), 2, "BNSD")




# ---- documented arguments npu_inject never passes: refused, not approximated ---------


@pytest.mark.parametrize(
    "layout,kwargs,match",
    [
        ("BSH", {}, "input_layout='BSH'"),
        ("SBH", {}, "input_layout='SBH'"),
        ("BNSD", {"pse": torch.zeros(1, 2, 4, 4)}, "pse"),
        ("BNSD", {"atten_mask": ~torch.eye(4, dtype=torch.bool), "sparse_mode": 5, "prefix": [2]}, "sparse_mode=5"),
        ("BNSD", {"atten_mask": COMPRESSED, "sparse_mode": 6, "prefix": [2]}, "sparse_mode=6"),
        ("TND", {"atten_mask": COMPRESSED, "sparse_mode": 7, "actual_seq_qlen": [4], "actual_seq_kvlen": [4]},
         "sparse_mode=7"),
        ("TND", {"atten_mask": COMPRESSED, "sparse_mode": 8, "actual_seq_qlen": [4], "actual_seq_kvlen": [4]},
         "sparse_mode=8"),
        ("BNSD", {"prefix": [2]}, "prefix"),
    ],
)
def test_unimplemented_arguments_raise(layout, kwargs, match):
    q = randn(1, 2, 4, 8)
    q = q[0].transpose(0, 1) if layout == "TND" else q
    with pytest.raises(NotImplementedError, match=match):
        fa(q, q, q, 2, layout, **kwargs)


def test_glue_computes_logsumexp_only_when_asked(request):
    """fusion_attention_BLNH's log-sum-exp costs two launches (a log, an add): callers that discard it get None;
    asked for, it is the causal scores' logsumexp (explicit matmul and mask, upstream math)."""
    from npu_inject import selection
    from npu_inject.ops.attention import AttentionPlan, fusion_attention_BLNH

    selection.establish({"TORCHTITAN_NPU": "cpu"})  # the rehearsal's kernels, as a training run's plan picks
    request.addfinalizer(selection.forget)
    q_BLNH, k_BLNH, v_BLNH = (randn(1, 6, 2, 8, seed=seed) for seed in (5, 6, 7))
    out_BLNH, lse_BLN = fusion_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, AttentionPlan(), None)
    assert lse_BLN is None
    again_BLNH, lse_BLN = fusion_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, AttentionPlan(), None, return_lse=True)
    torch.testing.assert_close(again_BLNH, out_BLNH)
    scores_BNLL = q_BLNH.transpose(1, 2) @ k_BLNH.transpose(1, 2).transpose(-1, -2) / math.sqrt(8)
    scores_BNLL = scores_BNLL.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse_BLN, scores_BNLL.logsumexp(-1).transpose(1, 2), atol=1e-5, rtol=1e-5)
