"""The attention patch on torchtitan's own modules vs. independent PyTorch math (SDPA + explicit masks).

Runs in the CPU rehearsal, where the kernel is the reference npu_fusion_attention.
The expected values never go through the patch or the reference: masks come from
torchtitan's own mask mods evaluated densely, attention from SDPA, in fp32.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from testkit import clean_env
from npu_inject import runtime

B, L, N, N_KV, H = 2, 24, 4, 2, 8


@pytest.fixture
def patched():
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="device,attention"),
                          install_hooks=False)
    for module in ("torchtitan.tools.utils", "torchtitan.models.common.decoder"):
        importlib.import_module(module)
    assert rt.apply("device") and rt.apply("attention"), rt.report.patches["attention"].reason
    from torchtitan.models.common import attention, decoder

    yield rt, attention, decoder
    rt.revert_all()


def qkv(seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda heads: torch.randn(B, L, heads, H, generator=generator, requires_grad=True)  # noqa: E731
    return make(N), make(N_KV), make(N_KV)


def positions_with_documents():
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(B, 1)
    positions[1] = torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)])
    return positions


def sdpa_expected(q_BLNH, k_BLNH, v_BLNH, keep_BLL, scale=None):
    groups = N // k_BLNH.shape[2]
    q = q_BLNH.transpose(1, 2)
    k = k_BLNH.transpose(1, 2).repeat_interleave(groups, dim=1)
    v = v_BLNH.transpose(1, 2).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep_BLL.unsqueeze(1), scale=scale)
    return out.transpose(1, 2)


def dense_keep(mask_mods):
    b = torch.arange(B).view(B, 1, 1)
    q_idx = torch.arange(L).view(1, L, 1)
    kv_idx = torch.arange(L).view(1, 1, L)
    keep = torch.ones(B, L, L, dtype=torch.bool)
    for mask_mod in mask_mods:
        keep &= mask_mod(b, None, q_idx, kv_idx)
    return keep


def assert_same_with_grads(actual, expected, inputs):
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=1e-5)
    upstream = torch.randn_like(expected)
    grads_actual = torch.autograd.grad(actual, inputs, upstream)
    grads_expected = torch.autograd.grad(expected, inputs, upstream)
    for got, want in zip(grads_actual, grads_expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def flex_case(attention, decoder, mask_mods, positions, scale=None):
    from npu_inject.ops.attention import AttentionPlan

    config = attention.FlexAttention.Config()
    attn_config = type("AttnConfig", (), {"inner_attention": config})()
    plan = decoder.Decoder._create_flex_attention_mask(object.__new__(decoder.Decoder), positions, attn_config, mask_mods)
    assert isinstance(plan, AttentionPlan), "this mask should run on the fused kernel"
    module = attention.FlexAttention(config)
    q, k, v = qkv()
    out = module(q, k, v, attention_masks=plan, scale=scale, enable_gqa=True)
    expected = sdpa_expected(q, k, v, dense_keep(mask_mods), scale)
    assert_same_with_grads(out, expected, (q, k, v))
    return plan


def test_flex_causal_gqa(patched):
    rt, attention, decoder = patched
    plan = flex_case(attention, decoder, [attention.get_causal_mask_mod()], positions_with_documents())
    assert plan.document_ends is None and plan.window is None
    assert rt.report.patches["attention"].fallbacks == []


def test_flex_causal_scale_honoured(patched):
    _, attention, decoder = patched
    flex_case(attention, decoder, [attention.get_causal_mask_mod()], positions_with_documents(), scale=0.3)


def test_flex_packed_documents_use_tnd(patched):
    _, attention, decoder = patched
    positions = positions_with_documents()
    mods = [attention.get_causal_mask_mod(), attention.get_efficient_causal_mask_mod_for_packed_document(positions)]
    plan = flex_case(attention, decoder, mods, positions)
    assert plan.document_ends == (10, 24, 29, 41, 48)
    # What the kernel (npu_fusion_attention_v3) and compiled blocks read: the same ends as a CPU int64 tensor.
    ends = plan.document_ends_tensor
    assert (ends.device.type, ends.dtype, ends.tolist()) == ("cpu", torch.int64, [10, 24, 29, 41, 48])


def test_flex_sliding_window_uses_band(patched):
    _, attention, decoder = patched
    mods = [attention.get_causal_mask_mod(), attention.get_sliding_window_mask_mod(5)]
    plan = flex_case(attention, decoder, mods, positions_with_documents())
    assert plan.window == 5


def test_unknown_mask_falls_back_to_reference(patched):
    from torch.nn.attention.flex_attention import create_block_mask

    rt, attention, _ = patched
    block_mod = attention.get_fixed_block_mask_mod(6)
    block_mask = create_block_mask(block_mod, B, None, L, L, device="cpu")
    module = attention.FlexAttention(attention.FlexAttention.Config())
    for _ in range(2):
        q, k, v = qkv(1)
        out = module(q, k, v, attention_masks=block_mask, enable_gqa=True)
        assert_same_with_grads(out, sdpa_expected(q, k, v, dense_keep([block_mod])), (q, k, v))
    fallbacks = rt.report.patches["attention"].fallbacks
    assert len(fallbacks) == 1 and "cannot express" in fallbacks[0]


@pytest.mark.parametrize("window_size", [(-1, 0), (3, 0), (-1, -1)])
def test_varlen_windows(patched, window_size):
    _, attention, _ = patched
    positions = positions_with_documents()
    metadata = attention.create_varlen_metadata_for_document(positions)
    module = attention.VarlenAttention(attention.VarlenAttention.Config(window_size=window_size))
    q, k, v = qkv(2)
    out = module(q, k, v, attention_masks=metadata, enable_gqa=True)
    document = torch.cumsum((positions == 0).int(), dim=1)
    keep = document.unsqueeze(2) == document.unsqueeze(1)
    q_idx, kv_idx = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    left, right = window_size
    if right == 0:
        keep &= kv_idx <= q_idx
    if left >= 0:
        keep &= q_idx - kv_idx <= left
    assert_same_with_grads(out, sdpa_expected(q, k, v, keep), (q, k, v))


def test_compressed_mask_is_built_once_per_device(patched):
    from npu_inject.ops import attention as ops_attention

    first = ops_attention.compressed_causal_mask(torch.device("cpu"))
    assert ops_attention.compressed_causal_mask(torch.device("cpu")) is first
    assert first.shape == (2048, 2048) and first.dtype == torch.bool
    assert torch.equal(first, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))


# ---- fallbacks to reference attention: score_mod, out_transform ---------------------


def explicit_keep(B_, L_, causal=True, window=None, document_ends=None):
    """(B, L, L) keep mask (True = attend) from explicit loops over batch, query and key."""
    def document(t):  # index of the packed document holding flat token t
        return next(number for number, end in enumerate(document_ends) if t < end)

    keep = torch.zeros(B_, L_, L_, dtype=torch.bool)
    for b in range(B_):
        for i in range(L_):
            for j in range(L_):
                keep[b, i, j] = (
                    (not causal or j <= i)
                    and (window is None or i - j < window)
                    and (document_ends is None or document(b * L_ + i) == document(b * L_ + j))
                )
    return keep


def expected_scores_BNLL(q_BLNH, k_BLNH, keep_BLL, scale, bias_BNLL=None):
    """scale * q k^T (+ bias), masked to -inf, with K repeated per query-head group."""
    groups = N // k_BLNH.shape[2]
    q = q_BLNH.transpose(1, 2)
    k = k_BLNH.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias_BNLL is not None:
        scores = scores + bias_BNLL
    return scores.masked_fill(~keep_BLL.unsqueeze(1), float("-inf"))


def causal_plan(decoder, attention, positions, mask_mods):
    from npu_inject.ops.attention import AttentionPlan

    config = attention.FlexAttention.Config()
    attn_config = type("AttnConfig", (), {"inner_attention": config})()
    create_mask = decoder.Decoder._create_flex_attention_mask
    plan = create_mask(object.__new__(decoder.Decoder), positions, attn_config, mask_mods)
    assert isinstance(plan, AttentionPlan)
    return attention.FlexAttention(config), plan


def test_flex_score_mod_falls_back_to_reference(patched):
    rt, attention, decoder = patched
    module, plan = causal_plan(decoder, attention, positions_with_documents(), [attention.get_causal_mask_mod()])
    slopes_N = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes_N[h] * (kv_idx - q_idx)

    # The same bias, element by element.
    bias_BNLL = torch.zeros(B, N, L, L)
    for h in range(N):
        for i in range(L):
            for j in range(L):
                bias_BNLL[:, h, i, j] = slopes_N[h] * (j - i)
    keep_BLL = explicit_keep(B, L)
    for _ in range(2):
        q, k, v = qkv(3)
        out = module(q, k, v, attention_masks=plan, score_mod=alibi, scale=0.3, enable_gqa=True)
        float_mask_BNLL = bias_BNLL.masked_fill(~keep_BLL.unsqueeze(1), float("-inf"))
        groups = N // N_KV
        expected = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(groups, dim=1),
            v.transpose(1, 2).repeat_interleave(groups, dim=1), attn_mask=float_mask_BNLL, scale=0.3,
        ).transpose(1, 2)
        assert_same_with_grads(out, expected, (q, k, v))
    fallbacks = rt.report.patches["attention"].fallbacks
    assert len(fallbacks) == 1 and "score_mod" in fallbacks[0]


def test_flex_out_transform_gets_logsumexp(patched):
    rt, attention, decoder = patched
    positions = positions_with_documents()
    mods = [attention.get_causal_mask_mod(), attention.get_efficient_causal_mask_mod_for_packed_document(positions)]
    module, plan = causal_plan(decoder, attention, positions, mods)
    keep_BLL = explicit_keep(B, L, document_ends=(10, 24, 29, 41, 48))
    seen = []

    def sink(out_BLNH, lse_BLN):  # gpt-oss's attention sink: rescale by sigmoid(lse - sink)
        seen.append(lse_BLN)
        return out_BLNH * torch.sigmoid(lse_BLN - 0.5).unsqueeze(-1)

    for _ in range(2):
        q, k, v = qkv(4)
        out = module(q, k, v, attention_masks=plan, out_transform=sink, enable_gqa=True)
        lse_BLN = torch.logsumexp(expected_scores_BNLL(q, k, keep_BLL, H**-0.5), dim=-1).transpose(1, 2)
        torch.testing.assert_close(seen[-1], lse_BLN, atol=2e-6, rtol=1e-5)
        expected = sdpa_expected(q, k, v, keep_BLL) * torch.sigmoid(lse_BLN - 0.5).unsqueeze(-1)
        assert_same_with_grads(out, expected, (q, k, v))
    fallbacks = rt.report.patches["attention"].fallbacks
    assert len(fallbacks) == 1 and "out_transform" in fallbacks[0]


def test_varlen_out_transform_gets_logsumexp(patched):
    rt, attention, _ = patched
    positions = positions_with_documents()
    metadata = attention.create_varlen_metadata_for_document(positions)
    module = attention.VarlenAttention(attention.VarlenAttention.Config(window_size=(3, 0)))
    keep_BLL = explicit_keep(B, L, window=4, document_ends=(10, 24, 29, 41, 48))
    seen = []

    def sink(out_BLNH, lse_BLN):
        seen.append(lse_BLN)
        return out_BLNH * torch.sigmoid(lse_BLN + 0.25).unsqueeze(-1)

    for _ in range(2):
        q, k, v = qkv(5)
        out = module(q, k, v, attention_masks=metadata, scale=0.2, out_transform=sink, enable_gqa=True)
        lse_BLN = torch.logsumexp(expected_scores_BNLL(q, k, keep_BLL, 0.2), dim=-1).transpose(1, 2)
        torch.testing.assert_close(seen[-1], lse_BLN, atol=2e-6, rtol=1e-5)
        expected = sdpa_expected(q, k, v, keep_BLL, scale=0.2) * torch.sigmoid(lse_BLN + 0.25).unsqueeze(-1)
        assert_same_with_grads(out, expected, (q, k, v))
    fallbacks = rt.report.patches["attention"].fallbacks
    assert len(fallbacks) == 1 and "VarlenAttention with an out_transform" in fallbacks[0]


def gpt_oss_attention_with_sinks(sinks_N):
    """A gpt_oss Attention holding only its sinks: its bound ``_apply_sinks`` is what the model passes."""
    model = importlib.import_module("torchtitan.models.gpt_oss.model")
    layer = model.Attention.__new__(model.Attention)
    torch.nn.Module.__init__(layer)
    layer.sinks = torch.nn.Parameter(sinks_N.clone())
    return layer


@pytest.mark.parametrize("inner", ["flex", "varlen"])
def test_gpt_oss_sinks_run_on_the_kernel(patched, inner):
    """gpt_oss's _apply_sinks is the kernel's sink: no fallback, and upstream's out * sigmoid(lse - sinks)
    computed here from SDPA and explicit log-sum-exps, sinks' gradient included."""
    rt, attention, decoder = patched
    positions = positions_with_documents()
    layer = gpt_oss_attention_with_sinks(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    if inner == "flex":
        mods = [attention.get_causal_mask_mod(),
                attention.get_efficient_causal_mask_mod_for_packed_document(positions)]
        module, masks = causal_plan(decoder, attention, positions, mods)
        keep_BLL, scale = explicit_keep(B, L, document_ends=(10, 24, 29, 41, 48)), H**-0.5
        call = dict(attention_masks=masks, enable_gqa=True)
    else:
        module = attention.VarlenAttention(attention.VarlenAttention.Config(window_size=(3, 0)))
        masks = attention.create_varlen_metadata_for_document(positions)
        keep_BLL, scale = explicit_keep(B, L, window=4, document_ends=(10, 24, 29, 41, 48)), 0.2
        call = dict(attention_masks=masks, scale=0.2, enable_gqa=True)
    q, k, v = qkv(6)
    out = module(q, k, v, out_transform=layer._apply_sinks, **call)
    sinks_ref = layer.sinks.detach().clone().requires_grad_()
    lse_BLN = torch.logsumexp(expected_scores_BNLL(q, k, keep_BLL, scale), dim=-1).transpose(1, 2)
    expected = sdpa_expected(q, k, v, keep_BLL, scale=scale) * torch.sigmoid(lse_BLN - sinks_ref).unsqueeze(-1)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    got = torch.autograd.grad((out * weights).sum(), (q, k, v, layer.sinks))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v, sinks_ref))
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=name)
    assert rt.report.patches["attention"].fallbacks == []


def test_gpt_oss_sinks_are_recognised_under_torch_compile(patched):
    """torch.compile sees the layer's bound method too (no fallback, no graph break): the same output and
    sinks gradient as eager."""
    rt, attention, _ = patched
    layer = gpt_oss_attention_with_sinks(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    module = attention.VarlenAttention(attention.VarlenAttention.Config(window_size=(3, 0)))
    metadata = attention.create_varlen_metadata_for_document(positions_with_documents())

    def forward(q, k, v):
        return module(q, k, v, attention_masks=metadata, scale=0.2, out_transform=layer._apply_sinks,
                      enable_gqa=True)

    q, k, v = qkv(7)
    eager = forward(q, k, v)
    eager.sum().backward()
    eager_sinks_grad, layer.sinks.grad = layer.sinks.grad, None
    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True)(q, k, v)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(layer.sinks.grad, eager_sinks_grad)
    assert rt.report.patches["attention"].fallbacks == []


# ---- plan_keep_mask: the dense mask of a plan, for the fallbacks ---------------------


PLAN_CASES = [
    (True, None, None),  # causal
    (True, 5, None),  # sliding window
    (True, None, (10, 24, 29, 41, 48)),  # packed documents
    (True, 3, (10, 24, 29, 41, 48)),  # sliding window inside documents
    (False, None, None),  # full
    (False, None, (10, 24, 29, 41, 48)),  # full inside documents (varlen (-1, -1))
]


# Packed plans also as varlen's plan inside a compiled block, which carries the ends tensor only.
@pytest.mark.parametrize(
    "causal,window,document_ends,ends_as",
    [(*case, "host ints") for case in PLAN_CASES] + [(*case, "tensor") for case in PLAN_CASES if case[2]],
)
def test_plan_keep_mask_matches_explicit_loops(causal, window, document_ends, ends_as):
    from npu_inject.ops.attention import AttentionPlan, plan_keep_mask

    if ends_as == "tensor":
        plan = AttentionPlan(causal=causal, window=window, document_ends_tensor=torch.tensor(document_ends))
    else:
        plan = AttentionPlan(causal=causal, window=window, document_ends=document_ends)
    keep_B1LL = plan_keep_mask(plan, B, L, L, torch.device("cpu"))
    assert keep_B1LL.shape == (B, 1, L, L) and keep_B1LL.dtype == torch.bool
    assert torch.equal(keep_B1LL[:, 0], explicit_keep(B, L, causal, window, document_ends))


# ---- selective activation checkpointing: a recompute runs the forward's ops ----------


def test_varlen_under_selective_checkpoint_with_another_batch_between(patched):
    # Pipeline schedules run the next microbatch's forward before this one's backward. Selective
    # checkpointing then replays this block's ops by count; the host document ends must not be read
    # in the recompute when the forward did not (or the other way round): torch raises "aten.slice
    # invocation index N encountered during backward but not found in storage".
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    _, attention, _ = patched
    module = attention.VarlenAttention(attention.VarlenAttention.Config(window_size=(-1, 0)))
    policy = lambda ctx, func, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731

    def layer(q, k, v, metadata):  # one checkpointed block per layer, as torchtitan wraps them
        return checkpoint(lambda *a: module(*a, attention_masks=metadata, enable_gqa=True), q, k, v,
                          use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy))

    def block(q, k, v, metadata):
        return layer(layer(q, k, v, metadata), k, v, metadata)

    positions = positions_with_documents()
    other = torch.arange(L).repeat(B, 1)
    metadata, other_metadata = (attention.create_varlen_metadata_for_document(p) for p in (positions, other))
    q, k, v = qkv(7)
    out = block(q, k, v, metadata)
    block(*qkv(8), other_metadata)  # the next microbatch's forward
    document = torch.cumsum((positions == 0).int(), dim=1)
    keep = (document.unsqueeze(2) == document.unsqueeze(1)) & torch.ones(L, L, dtype=torch.bool).tril()
    expected = sdpa_expected(sdpa_expected(q, k, v, keep), k, v, keep)
    assert_same_with_grads(out, expected, (q, k, v))


def test_decoder_forward_gives_varlen_metadata_torchtitans_host_offsets(patched):
    from npu_inject.patches.attention import with_host_offsets

    _, attention, _ = patched
    positions = positions_with_documents()
    upstream = attention.create_varlen_metadata_for_document(positions, include_host_offsets=True)
    filled = with_host_offsets(attention.create_varlen_metadata_for_document(positions))
    assert filled.cu_seq_q_host == upstream.cu_seq_q_host == (0, 10, 24, 29, 41, 48)
    assert filled.max_q == upstream.max_q and torch.equal(filled.cu_seq_q, upstream.cu_seq_q)
    assert with_host_offsets({"global": filled, "none": None}) == {"global": filled, "none": None}
