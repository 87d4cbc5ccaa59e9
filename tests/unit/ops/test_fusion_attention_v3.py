"""npu_fusion_attention_v3 (TND lengths as CPU tensors) against independent math and torch_npu's own fake.

Expected values are explicit masked softmax attention written here (float64, a dense
per-token keep mask built from the document lengths, repeat_interleave'd key/value
heads), never the reference's own code. Both the reference function and the custom op
the rehearsal compiles (``torch.ops.npu_inject.npu_fusion_attention_v3``, gradients
through register_kernel's backward op) are checked, forward and backward. Output
shapes, strides and dtypes of our fake are compared with the op's real outputs and
with torch_npu 2.14.0's own fake registration, read from the wheel (never imported).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import sys

import pytest
import torch

from kernelkit import NODEF, POS, randn
from testkit import REPO
from npu_inject.ops import reference as ref

sys.path.insert(0, REPO)
from verification.sim_npu import torch_npu_wheel  # noqa: E402

COMPRESSED = torch.triu(torch.ones(2048, 2048), diagonal=1).bool()

# npu_native_functions_by_codegen.yaml, npu_fusion_attention_v3 (the docs' prototype lacks sink).
SCHEMA_SIGNATURE = [
    ("query", POS, NODEF), ("key", POS, NODEF), ("value", POS, NODEF), ("head_num", POS, NODEF),
    ("input_layout", POS, NODEF), ("pse", POS, None), ("padding_mask", POS, None), ("atten_mask", POS, None),
    ("scale", POS, 1.0), ("keep_prob", POS, 1.0), ("pre_tockens", POS, 2147483647),
    ("next_tockens", POS, 2147483647), ("inner_precise", POS, 0), ("prefix", POS, None),
    ("actual_seq_qlen", POS, None), ("actual_seq_kvlen", POS, None), ("sparse_mode", POS, 0),
    ("gen_mask_parallel", POS, True), ("sync", POS, False), ("softmax_layout", POS, ""), ("sink", POS, None),
]


def test_signature_matches_the_schema():
    parameters = inspect.signature(ref.npu_fusion_attention_v3).parameters.values()
    assert [(p.name, p.kind, p.default) for p in parameters] == SCHEMA_SIGNATURE


def explicit_attention(q_TND, k_TND, v_TND, lengths, causal=True, window=None, scale=1.0):
    """(out_TND, lse_TN) in float64: each token attends to the tokens of its own document only."""
    document = torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)])
    index = torch.arange(len(document))
    keep_TT = document[:, None] == document[None, :]
    if causal:
        keep_TT &= index[None, :] <= index[:, None]
    if window is not None:
        keep_TT &= index[:, None] - index[None, :] < window
    groups = q_TND.shape[1] // k_TND.shape[1]
    q_NTD = q_TND.double().transpose(0, 1)
    k_NTD = k_TND.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    v_NTD = v_TND.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    scores_NTT = (q_NTD @ k_NTD.transpose(-1, -2) * scale).masked_fill(~keep_TT, float("-inf"))
    lse_NT = torch.logsumexp(scores_NTT, dim=-1)
    out_NTD = torch.exp(scores_NTT - lse_NT[..., None]) @ v_NTD
    return out_NTD.transpose(0, 1), lse_NT.transpose(0, 1)


def _rehearsal_op(*args, **kwargs):
    from npu_inject.ops import rehearsal

    return rehearsal.npu_fusion_attention_v3(*args, **kwargs)


KERNELS = {"reference": lambda *a, **k: ref.npu_fusion_attention_v3(*a, **k), "compiled op": _rehearsal_op}

# (document lengths, query heads, key/value heads, mode): causal (3), band (4, window 3), full (0).
CASES = [
    ([7, 9], 4, 4, "causal"),
    ([1, 5, 3, 7], 4, 2, "causal"),  # GQA, a one-token document
    ([16], 6, 1, "causal"),  # one document, MQA
    ([4, 4, 8], 4, 2, "band"),
    ([3, 10, 3], 2, 2, "full"),
]


def _mode_arguments(mode):
    if mode == "causal":
        return {"sparse_mode": 3, "atten_mask": COMPRESSED}, {"causal": True}
    if mode == "band":
        return {"sparse_mode": 4, "atten_mask": COMPRESSED, "pre_tockens": 2, "next_tockens": 0}, \
            {"causal": True, "window": 3}
    return {"sparse_mode": 0}, {"causal": False}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lengths,nq,nkv,mode", CASES)
def test_forward_and_backward_match_explicit_attention(kernel, lengths, nq, nkv, mode):
    tokens, scale = sum(lengths), 0.4
    q = randn(tokens, nq, 8, seed=1, requires_grad=True)
    k = randn(tokens, nkv, 8, seed=2, requires_grad=True)
    v = randn(tokens, nkv, 8, seed=3, requires_grad=True)
    ends = torch.tensor(list(itertools.accumulate(lengths)), dtype=torch.int64)
    kernel_arguments, mask = _mode_arguments(mode)
    outputs = KERNELS[kernel](q, k, v, nq, "TND", scale=scale, actual_seq_qlen=ends, actual_seq_kvlen=ends,
                              softmax_layout="TND", **kernel_arguments)
    assert len(outputs) == 6 and all(isinstance(t, torch.Tensor) for t in outputs)
    out, softmax_max, softmax_sum, softmax_out, seed, offset = outputs

    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    expected_out, expected_lse = explicit_attention(q64, k64, v64, lengths, scale=scale, **mask)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    lse = softmax_max[..., 0] + softmax_sum[..., 0].log()  # token-major (softmax_layout="TND")
    torch.testing.assert_close(lse.double(), expected_lse.detach(), rtol=1e-5, atol=1e-5)
    assert (softmax_out.shape, seed.shape, offset.shape) == ((0,), (1,), (1,))
    assert seed.dtype == offset.dtype == torch.int64

    grad_out = randn(tokens, nq, 8, seed=4)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected_out, (q64, k64, v64), grad_out.double())
    for name, grad, expected in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["causal", "full"])
def test_documents_longer_than_a_tile(kernel, mode, monkeypatch):
    # Tiles of 64 tokens: documents start and end inside tiles and none is a multiple of 64.
    from npu_inject.ops.reference import fusion_attention

    monkeypatch.setattr(fusion_attention, "TILE_SIDE", 64)
    test_forward_and_backward_match_explicit_attention(kernel, [150, 61, 209], 4, 2, mode)


def test_int32_lengths_are_read_like_int64():
    # torch_npu converts a non-int64 length tensor on the host (op-plugin's ToIntArrayRef).
    q, k, v = (randn(12, 2, 4, seed=s) for s in (1, 2, 3))
    ends32 = torch.tensor([5, 12], dtype=torch.int32)
    out32, *_ = ref.npu_fusion_attention_v3(q, k, v, 2, "TND", atten_mask=COMPRESSED, sparse_mode=3,
                                            actual_seq_qlen=ends32, actual_seq_kvlen=ends32)
    expected, _ = explicit_attention(q, k, v, [5, 7])
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths,match", [
    (torch.tensor([4, 8], device="meta"), "1-D CPU integer tensor"),
    (torch.tensor([[4, 8]]), "1-D CPU integer tensor"),
    (torch.tensor([4.0, 8.0]), "1-D CPU integer tensor"),
    ([4, 8], "npu_fusion_attention .v1. is the variant taking a list"),
])
def test_lengths_that_torch_npu_rejects_raise_naming_the_argument(lengths, match):
    q, k, v = (randn(8, 2, 4, seed=s) for s in (1, 2, 3))
    with pytest.raises((TypeError, ValueError), match=match) as error:
        ref.npu_fusion_attention_v3(q, k, v, 2, "TND", actual_seq_qlen=lengths, actual_seq_kvlen=lengths)
    assert "actual_seq_qlen" in str(error.value)


def explicit_sink_attention_BNSD(q, k, v, keep_SS, sinks_N, scale):
    """float64: softmax over the scores and one appended sink logit per head, that column dropped before v
    (torch_npu's example for sink)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~keep_SS, float("-inf"))
    sink_column = sinks_N.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return probs @ v


@pytest.mark.parametrize("layout, n_kv, sparse_mode", [("BNSD", 4, 2), ("BSND", 2, 3), ("BSND", 1, 0)])
def test_sink_matches_a_softmax_with_one_more_logit_forward_and_backward(layout, n_kv, sparse_mode):
    B, N, S, D = 2, 4, 11, 8
    q = randn(B, N, S, D, seed=1, requires_grad=True)
    k, v = (randn(B, n_kv, S, D, seed=s, requires_grad=True) for s in (2, 3))
    sinks = (torch.linspace(-1.0, 2.0, N)).requires_grad_()
    index = torch.arange(S)
    keep_SS = (index[None, :] <= index[:, None]) if sparse_mode in (2, 3) else torch.ones(S, S, dtype=torch.bool)
    mask = {} if sparse_mode == 0 else {"atten_mask": COMPRESSED, "sparse_mode": sparse_mode}
    as_layout = (lambda t: t.transpose(1, 2)) if layout == "BSND" else (lambda t: t)
    out, smax, ssum, *_ = ref.npu_fusion_attention(*(as_layout(t) for t in (q, k, v)), N, layout, scale=0.3,
                                                   sink=sinks, **mask)
    expected = explicit_sink_attention_BNSD(q, k, v, keep_SS, sinks, 0.3)
    torch.testing.assert_close(as_layout(out).double(), expected, rtol=1e-5, atol=1e-5)
    weights = randn(*expected.shape, seed=9).double()
    got = torch.autograd.grad((as_layout(out).double() * weights).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v, sinks))
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)
    # The statistics count the sink: max over the row's scores and the sink, sum of exp(x - max) over both.
    scores = torch.cat([(q.double() @ k.double().repeat_interleave(N // n_kv, 1).transpose(-1, -2) * 0.3)
                        .masked_fill(~keep_SS, float("-inf")), sinks.double().view(1, N, 1, 1).expand(B, N, S, 1)], -1)
    torch.testing.assert_close(smax[..., 0].double(), scores.amax(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ssum[..., 0].double(), torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_sink_is_gpt_oss_rescale_of_the_sinkless_output_in_tnd(kernel):
    """TND, two documents: with sink, upstream gpt_oss's out * sigmoid(lse - sink) of explicit attention, forward
    and backward (dsink too), from the reference and from the custom op the rehearsal compiles."""
    lengths, N = [5, 7], 4
    q, k, v = (randn(12, N, 8, seed=s, requires_grad=True) for s in (4, 5, 6))
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0], requires_grad=True)
    ends = torch.tensor([5, 12])
    kw = dict(actual_seq_qlen=ends, actual_seq_kvlen=ends, atten_mask=COMPRESSED, sparse_mode=3, scale=0.5)
    with_sink = KERNELS[kernel](q, k, v, N, "TND", sink=sinks, **kw)[0]
    out, lse = explicit_attention(q, k, v, lengths, scale=0.5)
    expected = out * torch.sigmoid(lse - sinks.double()).unsqueeze(-1)
    torch.testing.assert_close(with_sink.double(), expected, rtol=1e-5, atol=1e-5)
    weights = randn(*expected.shape, seed=7).double()
    got = torch.autograd.grad((with_sink.double() * weights).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v, sinks))
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("sink, match", [(torch.zeros(3), "head_num=2"), (torch.zeros(2, dtype=torch.float64), "float32")])
def test_a_wrong_sink_is_named(sink, match):
    q, k, v = (randn(8, 2, 4, seed=s) for s in (1, 2, 3))
    ends = torch.tensor([8])
    with pytest.raises(ValueError, match=match):
        ref.npu_fusion_attention_v3(q, k, v, 2, "TND", actual_seq_qlen=ends, actual_seq_kvlen=ends, sink=sink)


# -- the fake: our op's real outputs and torch_npu's own fake registration --------------------


@pytest.fixture(scope="module")
def torch_npu_fake():
    """torch_npu 2.14.0's fake for npu_fusion_attention_v3, compiled from the wheel's source (not imported)."""
    source = torch_npu_wheel.wheel().read("torch_npu/op_plugin/meta/_fake_registrations.py").decode()
    (function,) = [node for node in ast.parse(source).body
                   if isinstance(node, ast.FunctionDef) and node.name == "npu_fusion_attention_forward_v3"]
    function.decorator_list = []
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "_fake_registrations.py", "exec"), namespace)
    return namespace["npu_fusion_attention_forward_v3"]


LAYOUT_SAMPLES = {
    "TND": lambda: ((randn(20, 4, 8), randn(20, 2, 8), randn(20, 2, 6), 4, "TND"),
                    {"atten_mask": COMPRESSED, "sparse_mode": 3, "actual_seq_qlen": torch.tensor([6, 20]),
                     "actual_seq_kvlen": torch.tensor([6, 20]), "softmax_layout": "TND"}),
    "BSND": lambda: ((randn(2, 10, 4, 8), randn(2, 10, 2, 8), randn(2, 10, 2, 8), 4, "BSND"),
                     {"atten_mask": COMPRESSED, "sparse_mode": 2}),
}


@pytest.mark.parametrize("layout", LAYOUT_SAMPLES)
def test_fake_gives_the_real_outputs_and_torch_npus_fake_shapes(layout, torch_npu_fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_inject.ops import rehearsal  # noqa: F401  (registers torch.ops.npu_inject.*)

    args, kwargs = LAYOUT_SAMPLES[layout]()
    op = torch.ops.npu_inject.npu_fusion_attention_v3
    real = op(*args, **kwargs)
    mode = FakeTensorMode()
    fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    with mode:
        ours = op(*fake_args, **fake_kwargs)
        theirs = torch_npu_fake(*fake_args, **fake_kwargs)
    assert len(real) == len(ours) == len(theirs) == 6

    def meta(t):
        return tuple(t.shape), t.stride(), t.dtype

    assert [meta(t) for t in ours] == [meta(t) for t in real]
    assert [meta(t) for t in ours] == [meta(t) for t in theirs]


def test_opcheck():
    """torch.library's own checks: schema, fake vs real, autograd registration, AOT dispatch."""
    from npu_inject.ops import rehearsal  # noqa: F401

    args, kwargs = LAYOUT_SAMPLES["TND"]()
    args = (*(t.requires_grad_(True) for t in args[:3]), *args[3:])
    torch.library.opcheck(torch.ops.npu_inject.npu_fusion_attention_v3.default, args, kwargs)
