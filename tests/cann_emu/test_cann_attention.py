"""Flash attention on the CANN emulation (verification/cann_emu/csrc/aten_attention.cpp, issue 20).

torch_npu 2.14.0's own ``npu_fusion_attention`` / ``npu_fusion_attention_v3`` and their autograd backward,
run in the emulation's venv, against plain CPU PyTorch: ``F.scaled_dot_product_attention`` in FLOAT32 on
the same (dtype-rounded) inputs with an explicit keep mask, per document for TND, and ``torch.logsumexp``
of explicitly computed scores for the softmax statistics. One child process computes every case; the
tests read its JSON.

Tolerances: FLOAT32 1e-4 absolute (the emulation computes in FLOAT32 as the reference does). BFLOAT16:
the output and gradients are rounded to BFLOAT16 (8 bits of mantissa, a relative step of 2**-8), so an
error up to 2**-7 of the largest reference magnitude plus 2**-8 absolute is accepted.
"""

from __future__ import annotations

import json

import pytest

from cann_emu_child import child_json

FP32_ATOL = 1e-4
BF16_RTOL, BF16_ATOL = 2.0**-7, 2.0**-8

CHILD = r"""
import json, math
import torch, torch_npu
import torch.nn.functional as F

torch.manual_seed(0)
COMPRESSED = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)  # True = masked out
results = {}

def err(a, b):
    return [float((a.float() - b.float()).abs().max()), float(b.abs().max())]

def sdpa_BNSD(q, k, v, keep, scale):
    # Plain PyTorch: GQA by repeating kv heads; keep is True where a key is attended.
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=keep, scale=scale)

def lse_BNS(q, k, keep, scale):
    group = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    return torch.logsumexp(scores.masked_fill(~keep, float("-inf")), dim=-1)

def compare(name, dtype, inputs, npu_fn, ref_fn):
    # npu_fn(q, k, v) on NPU leaves -> (out, *extra); ref_fn(q, k, v) on FLOAT32 CPU leaves -> out.
    rounded = [x.detach().to(dtype) for x in inputs]
    leaves = [x.npu().requires_grad_() for x in rounded]
    out, *extra = npu_fn(*leaves)
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad.npu())
    refs = [x.float().clone().requires_grad_() for x in rounded]
    ref = ref_fn(*refs)
    ref.backward(grad.float())
    results[name] = {"out": err(out.detach().cpu(), ref), "dtype": str(out.dtype)}
    for arg, leaf, ref_leaf in zip(("dq", "dk", "dv"), leaves, refs):
        results[name][arg] = err(leaf.grad.cpu(), ref_leaf.grad)
    return [e.detach().cpu() if isinstance(e, torch.Tensor) else e for e in extra]

B, S, N, NKV, D = 2, 40, 4, 2, 16
scale = 1 / math.sqrt(D)
causal = torch.ones(S, S, dtype=torch.bool).tril()

# BSND, causal (sparse_mode 2 with the compressed mask), GQA; FLOAT32 and BFLOAT16.
for dtype in (torch.float32, torch.bfloat16):
    q, k, v = torch.randn(B, S, N, D), torch.randn(B, S, NKV, D), torch.randn(B, S, NKV, D)
    extra = compare(f"bsnd_causal_gqa_{str(dtype)[6:]}", dtype, (q, k, v),
                    lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=COMPRESSED.npu(),
                                                                   sparse_mode=2, scale=scale),
                    lambda q, k, v: sdpa_BNSD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal,
                                              scale).transpose(1, 2))
    if dtype == torch.float32:
        smax, ssum = extra[0], extra[1]
        lse = lse_BNS(q.transpose(1, 2), k.transpose(1, 2), causal, scale)
        results["bsnd_stats"] = {"shape": list(smax.shape), "dtype": str(smax.dtype),
                                 "replicated": bool((smax == smax[..., :1]).all() and (ssum == ssum[..., :1]).all()),
                                 "lse": err(smax[..., 0] + ssum[..., 0].log(), lse)}

# A sequence long enough that the emulation splits each head's query rows into blocks (2**22 scores each).
L = 2100
q, k, v = torch.randn(1, L, 2, 8), torch.randn(1, L, 1, 8), torch.randn(1, L, 1, 8)
compare("bsnd_causal_blocks_float32", torch.float32, (q, k, v),
        lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=COMPRESSED.npu(),
                                                       sparse_mode=2, scale=scale),
        lambda q, k, v: sdpa_BNSD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  torch.ones(L, L, dtype=torch.bool).tril(), scale).transpose(1, 2))

# BNSD, explicit mask (sparse_mode 0, B1SS, True = masked), Sq != Skv.
SQ, SKV = 24, 32
q, k, v = torch.randn(B, N, SQ, D), torch.randn(B, N, SKV, D), torch.randn(B, N, SKV, D)
masked = torch.rand(B, 1, SQ, SKV) < 0.3
masked[..., 0] = False  # every row keeps a key
compare("bnsd_explicit_mask_float32", torch.float32, (q, k, v),
        lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, N, "BNSD", atten_mask=masked.npu(), sparse_mode=0,
                                                       scale=scale),
        lambda q, k, v: sdpa_BNSD(q, k, v, ~masked, scale))

# BSND sliding window (sparse_mode 4: pre_tockens = window - 1, next_tockens = 0, as npu_inject's band).
window = 8
ii, jj = torch.arange(S).unsqueeze(1), torch.arange(S).unsqueeze(0)
band = (jj <= ii) & (ii - jj < window)
q, k, v = torch.randn(B, S, N, D), torch.randn(B, S, NKV, D), torch.randn(B, S, NKV, D)
compare("bsnd_band_float32", torch.float32, (q, k, v),
        lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=COMPRESSED.npu(),
                                                       sparse_mode=4, pre_tockens=window - 1, next_tockens=0,
                                                       scale=scale),
        lambda q, k, v: sdpa_BNSD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), band,
                                  scale).transpose(1, 2))

# BSH and SBH (H = N * D), full attention (no mask), GQA.
q, k, v = torch.randn(B, S, N * D), torch.randn(B, S, NKV * D), torch.randn(B, S, NKV * D)
to_BNSD = lambda t: t.unflatten(2, (-1, D)).transpose(1, 2)
compare("bsh_float32", torch.float32, (q, k, v),
        lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, N, "BSH", scale=scale),
        lambda q, k, v: sdpa_BNSD(to_BNSD(q), to_BNSD(k), to_BNSD(v), None, scale).transpose(1, 2).flatten(2))
q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
compare("sbh_float32", torch.float32, (q, k, v),
        lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, N, "SBH", scale=scale),
        lambda q, k, v: sdpa_BNSD(*(to_BNSD(t.transpose(0, 1)) for t in (q, k, v)), None,
                                  scale).permute(2, 0, 1, 3).flatten(2))

# TND: two packed documents, each causal on its own (sparse_mode 3, compressed mask); v1 (lists,
# statistics in NTD order) and v3 (CPU int64 tensors, softmax_layout="TND").
lengths = (13, 27)
ends = [13, 40]
T = sum(lengths)
def tnd_reference(q, k, v):
    pieces, start = [], 0
    for length in lengths:
        doc = [t[start:start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        keep = torch.ones(length, length, dtype=torch.bool).tril()
        pieces.append(sdpa_BNSD(*doc, keep, scale)[0].transpose(0, 1))
        start += length
    return torch.cat(pieces)
def tnd_lse_NT(q, k):
    pieces, start = [], 0
    for length in lengths:
        doc = [t[start:start + length].transpose(0, 1).unsqueeze(0) for t in (q, k)]
        pieces.append(lse_BNS(*doc, torch.ones(length, length, dtype=torch.bool).tril(), scale)[0])
        start += length
    return torch.cat(pieces, dim=1)
for dtype in (torch.float32, torch.bfloat16):
    q, k, v = torch.randn(T, N, D), torch.randn(T, NKV, D), torch.randn(T, NKV, D)
    tag = str(dtype)[6:]
    extra = compare(f"tnd_v1_{tag}", dtype, (q, k, v),
                    lambda q, k, v: torch_npu.npu_fusion_attention(q, k, v, N, "TND", atten_mask=COMPRESSED.npu(),
                                                                   sparse_mode=3, scale=scale, actual_seq_qlen=ends,
                                                                   actual_seq_kvlen=ends),
                    tnd_reference)
    lse = tnd_lse_NT(q.to(dtype).float(), k.to(dtype).float())
    smax, ssum = extra[0], extra[1]
    # softmax_layout="": the (T, N, 8) buffer holds the statistics in N-major (NTD) order.
    results[f"tnd_v1_{tag}_stats"] = {"shape": list(smax.shape), "lse": err(
        smax.reshape(N, T, 8)[..., 0] + ssum.reshape(N, T, 8)[..., 0].log(), lse)}
    ends_T = torch.tensor(ends, dtype=torch.int64)
    extra = compare(f"tnd_v3_{tag}", dtype, (q, k, v),
                    lambda q, k, v: torch_npu.npu_fusion_attention_v3(q, k, v, N, "TND", atten_mask=COMPRESSED.npu(),
                                                                      sparse_mode=3, scale=scale,
                                                                      actual_seq_qlen=ends_T, actual_seq_kvlen=ends_T,
                                                                      softmax_layout="TND"),
                    tnd_reference)
    smax, ssum = extra[0], extra[1]
    results[f"tnd_v3_{tag}_stats"] = {"shape": list(smax.shape), "lse": err(
        smax[..., 0].t() + ssum[..., 0].t().log(), lse)}

# With sink (gpt_oss's attention sinks): one FLOAT32 logit per query head joins each row's softmax with a zero
# value. Reference: the explicit softmax over the scores and an appended sink column, dropped before v.
def sink_BNSD(q, k, v, keep, sink, scale):
    group = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ v.repeat_interleave(group, 1)

def compare_sink(name, dtype, inputs, sink, npu_fn, ref_fn):
    rounded = [x.detach().to(dtype) for x in inputs]
    leaves = [x.npu().requires_grad_() for x in rounded]
    sink_leaf = sink.clone().npu().requires_grad_()
    out = npu_fn(*leaves, sink_leaf)[0]
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad.npu())
    refs = [x.float().clone().requires_grad_() for x in rounded]
    sink_ref = sink.clone().requires_grad_()
    ref = ref_fn(*refs, sink_ref)
    ref.backward(grad.float())
    results[name] = {"out": err(out.detach().cpu(), ref), "dtype": str(out.dtype),
                     "dsink": err(sink_leaf.grad.cpu(), sink_ref.grad)}
    for arg, leaf, ref_leaf in zip(("dq", "dk", "dv"), leaves, refs):
        results[name][arg] = err(leaf.grad.cpu(), ref_leaf.grad)

sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
for dtype in (torch.float32, torch.bfloat16):
    q, k, v = torch.randn(B, S, N, D), torch.randn(B, S, NKV, D), torch.randn(B, S, NKV, D)
    compare_sink(f"bsnd_causal_sink_{str(dtype)[6:]}", dtype, (q, k, v), sink,
                 lambda q, k, v, s: torch_npu.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=COMPRESSED.npu(),
                                                                   sparse_mode=2, scale=scale, sink=s),
                 lambda q, k, v, s: sink_BNSD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, s,
                                              scale).transpose(1, 2))
def tnd_sink_reference(q, k, v, s):
    pieces, start = [], 0
    for length in lengths:
        doc = [t[start:start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        pieces.append(sink_BNSD(*doc, torch.ones(length, length, dtype=torch.bool).tril(), s, scale)[0]
                      .transpose(0, 1))
        start += length
    return torch.cat(pieces)
q, k, v = torch.randn(T, N, D), torch.randn(T, NKV, D), torch.randn(T, NKV, D)
ends_T = torch.tensor(ends, dtype=torch.int64)
compare_sink("tnd_v3_sink_float32", torch.float32, (q, k, v), sink,
             lambda q, k, v, s: torch_npu.npu_fusion_attention_v3(q, k, v, N, "TND", atten_mask=COMPRESSED.npu(),
                                                                  sparse_mode=3, scale=scale, actual_seq_qlen=ends_T,
                                                                  actual_seq_kvlen=ends_T, softmax_layout="TND",
                                                                  sink=s),
             tnd_sink_reference)

# Failures: a dtype CANN does not list (161002 naming the operator); dropout.
def failure(fn):
    try:
        fn()
        return "no error"
    except RuntimeError as error:
        return str(error)
x = torch.randn(1, 8, 2, 16, dtype=torch.float64).npu()
results["float64"] = failure(lambda: torch_npu.npu_fusion_attention(x, x, x, 2, "BSND"))
y = torch.randn(1, 8, 2, 16).npu()
results["dropout"] = failure(lambda: torch_npu.npu_fusion_attention(y, y, y, 2, "BSND", keep_prob=0.9))
# Given a dropout mask, torch_npu draws none and the attention operator itself is reached.
drop_mask = torch.ones(1 * 2 * 8 * 8 // 8, dtype=torch.uint8).npu()
results["dropout_given_mask"] = failure(lambda: torch_npu.npu_fusion_attention(
    y, y, y, 2, "BSND", keep_prob=0.9, dropout_mask=drop_mask))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    counts = tmp_path_factory.mktemp("cann_fa") / "counts.json"
    out = child_json(CHILD, timeout=600, extra_env={"CANN_EMU_COUNTS": str(counts)}, devices=1)
    out["counts"] = json.loads(counts.read_text())
    return out


def _within(error: list[float], dtype: str) -> bool:
    diff, magnitude = error
    if dtype == "float32":
        return diff <= FP32_ATOL
    return diff <= BF16_RTOL * magnitude + BF16_ATOL


CASES = ["bsnd_causal_gqa_float32", "bsnd_causal_gqa_bfloat16", "bsnd_causal_blocks_float32",
         "bnsd_explicit_mask_float32", "bsnd_band_float32",
         "bsh_float32", "sbh_float32", "tnd_v1_float32", "tnd_v1_bfloat16", "tnd_v3_float32", "tnd_v3_bfloat16"]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_sdpa(results, case):
    """out, dq, dk, dv through torch_npu's entry point and autograd equal SDPA's on the same inputs."""
    dtype = case.rsplit("_", 1)[1]
    got = results[case]
    assert got["dtype"] == f"torch.{dtype}"
    for name in ("out", "dq", "dk", "dv"):
        assert _within(got[name], dtype), \
            f"{case} {name}: max |diff| {got[name][0]:.3g} (reference max {got[name][1]:.3g})"


def test_softmax_statistics_in_cann_layout(results):
    """softmax_max / softmax_sum: FLOAT32 (B, N, S, 8), each value repeated 8 times; max + log(sum) is the
    log-sum-exp of the masked, scaled scores (what torch_npu passes back to the grad operator)."""
    stats = results["bsnd_stats"]
    assert stats["shape"] == [2, 4, 40, 8] and stats["dtype"] == "torch.float32" and stats["replicated"]
    assert stats["lse"][0] <= FP32_ATOL


SINK_CASES = ["bsnd_causal_sink_float32", "bsnd_causal_sink_bfloat16", "tnd_v3_sink_float32"]


@pytest.mark.parametrize("case", SINK_CASES)
def test_sink_forward_and_backward_match_a_softmax_with_one_more_logit(results, case):
    """With sink, out, dq, dk, dv and dsink against the explicit softmax over the scores and an appended
    sink column (its value 0): aclnnFlashAttentionScoreV3 / ScoreGradV3, VarLenScoreV5 / UnpaddingScoreGradV5."""
    dtype = case.rsplit("_", 1)[1]
    got = results[case]
    assert got["dtype"] == f"torch.{dtype}"
    for name in ("out", "dq", "dk", "dv", "dsink"):
        # dsink sums over every row of a head: a bf16 run's rounding adds up there.
        error = got[name] if name != "dsink" or dtype == "float32" else [got[name][0] / 8, got[name][1]]
        assert _within(error, dtype), \
            f"{case} {name}: max |diff| {got[name][0]:.3g} (reference max {got[name][1]:.3g})"


@pytest.mark.parametrize("case", ["tnd_v1_float32", "tnd_v1_bfloat16", "tnd_v3_float32", "tnd_v3_bfloat16"])
def test_tnd_statistics_order(results, case):
    """TND: a (T, N, 8) buffer, N-major (NTD) by default (v1), token-major with softmax_layout="TND" (v3)."""
    stats = results[f"{case}_stats"]
    assert stats["shape"] == [40, 4, 8]
    assert stats["lse"][0] <= (FP32_ATOL if case.endswith("float32") else 1e-3), stats


def test_the_operators_torch_npu_reached(results):
    """The forward and grad operators op-plugin picks on Atlas A2: without sink, TND with softmax_layout="TND" on
    the V4 pair, TND without it on VarLenScore / UnpaddingScoreGrad, the rest on Score / ScoreGrad; with sink,
    the ScoreV3 and VarLenScoreV5 pairs."""
    launched = results["counts"]["aclnn"]
    for name in ("aclnnFlashAttentionScore", "aclnnFlashAttentionScoreGrad", "aclnnFlashAttentionVarLenScore",
                 "aclnnFlashAttentionUnpaddingScoreGrad", "aclnnFlashAttentionVarLenScoreV4",
                 "aclnnFlashAttentionUnpaddingScoreGradV4", "aclnnFlashAttentionScoreV3",
                 "aclnnFlashAttentionScoreGradV3", "aclnnFlashAttentionVarLenScoreV5",
                 "aclnnFlashAttentionUnpaddingScoreGradV5"):
        assert launched.get(name, 0) >= 1, (name, launched)


def test_unsupported_dtype_fails_with_161002_naming_the_operator(results):
    assert "161002" in results["float64"] and "aclnnFlashAttentionScore" in results["float64"]


def test_dropout_fails_loudly(results):
    """keep_prob < 1 is not emulated: torch_npu first draws the mask (aclnnDropoutGenMaskV2, a loud stub);
    given a mask, the attention operator refuses with 561000 'dropout not emulated'."""
    assert "aclnnDropoutGenMaskV2GetWorkspaceSize is not implemented by the CANN emulation" in results["dropout"]
    given = results["dropout_given_mask"]
    assert "561000" in given and "aclnnFlashAttentionScore" in given and "dropout not emulated" in given, given
