"""Context-parallel attention (npu_inject.ops.cp) on 2 gloo ranks vs. dense SDPA on the whole sequence.

Each rank holds the head-tail load-balanced query/key/value rows torchtitan gives it;
its output and the gradients of its shards must equal the matching rows of the
whole-sequence attention computed with torch's SDPA and an explicit mask (fp32),
for both schemes, every mask kind and GQA down to one key/value head. The reference
path for an ``out_transform`` (gpt_oss's sinks: ``out * sigmoid(lse - sinks)``) is
checked the same way, its log-sum-exp against ``torch.logsumexp`` of the masked scores.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gloo import run_on_gloo_ranks

B, L, N, H, WORLD = 2, 16, 4, 8, 2
DOCUMENT_ENDS = (5, 16, 16 + 9, 32)  # row 0: documents of 5 and 11 tokens; row 1: 9 and 7
CASES = {
    "causal": dict(causal=True),
    "document": dict(causal=True, document_ends=DOCUMENT_ENDS),
    "window": dict(causal=True, window=5),
    "document_window": dict(causal=True, window=3, document_ends=DOCUMENT_ENDS),
    "full": dict(causal=False),
    "full_document": dict(causal=False, document_ends=DOCUMENT_ENDS),
}


def headtail_positions(rank: int) -> list[int]:
    chunk = L // (2 * WORLD)
    return list(range(rank * chunk, (rank + 1) * chunk)) + list(
        range((2 * WORLD - 1 - rank) * chunk, (2 * WORLD - rank) * chunk))


def dense_keep_BLL(case: dict) -> torch.Tensor:
    q_idx, kv_idx = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    keep = torch.ones(B, L, L, dtype=torch.bool)
    if case["causal"]:
        keep &= kv_idx <= q_idx
    if case.get("window"):
        keep &= q_idx - kv_idx < case["window"]
    if case.get("document_ends"):
        document = torch.zeros(B * L, dtype=torch.long)
        for end in case["document_ends"][:-1]:
            document[end:] += 1
        document = document.view(B, L)
        keep &= document.unsqueeze(2) == document.unsqueeze(1)
    return keep


def sdpa_BLNH(q, k, v, keep_BLL):
    groups = N // k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(groups, 1),
        v.transpose(1, 2).repeat_interleave(groups, 1), attn_mask=keep_BLL.unsqueeze(1))
    return out.transpose(1, 2)


def sinks_transformed_BLNH(q, k, v, keep_BLL, sinks_N):
    """gpt_oss's out_transform on whole-sequence attention: SDPA's output rescaled by sigmoid(lse - sinks)."""
    groups = N // k.shape[2]
    scores_BNLL = q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(groups, 1).transpose(-1, -2) / H ** 0.5
    lse_BLN = torch.logsumexp(scores_BNLL.masked_fill(~keep_BLL.unsqueeze(1), float("-inf")), -1).transpose(1, 2)
    return sdpa_BLNH(q, k, v, keep_BLL) * torch.sigmoid(lse_BLN - sinks_N).unsqueeze(-1)


def _worker(rank: int) -> list[str]:
    from npu_inject import selection

    selection.establish({"TORCHTITAN_NPU": "cpu"})  # the rehearsal's kernels, as a training run's plan picks
    from npu_inject.ops.attention import AttentionPlan
    from npu_inject.ops.cp import (
        ContextParallelPlan,
        context_parallel_attention_BLNH,
        context_parallel_reference_attention_BLNH,
    )

    local = headtail_positions(rank)
    balanced = tuple(p for r in range(WORLD) for p in headtail_positions(r))
    failures = []
    for name, case in CASES.items():
        for scheme in ("ulysses", "allgather"):
            for n_kv in (2, 1):
                generator = torch.Generator().manual_seed(7)
                q, k, v, grad_out = (torch.randn(B, L, heads, H, generator=generator)
                                     for heads in (N, n_kv, n_kv, N))
                q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                expected = sdpa_BLNH(q, k, v, dense_keep_BLL(case))
                expected.backward(grad_out)
                shards = [t.detach()[:, local].clone().requires_grad_(True) for t in (q, k, v)]
                cp = ContextParallelPlan(AttentionPlan(**case), None, tuple(local), balanced, scheme,
                                         dist.group.WORLD)
                out = context_parallel_attention_BLNH(*shards, cp, cp.plan, None)
                out.backward(grad_out[:, local])
                # Key/value as the spmd_types backend's inner-attention boundary hands them over: already
                # all-gathered (whole sequence, rank after rank); their gradients are partial over the ranks.
                q_shard = q.detach()[:, local].clone().requires_grad_(True)
                k_whole, v_whole = (t.detach()[:, list(balanced)].clone().requires_grad_(True) for t in (k, v))
                out_whole = context_parallel_attention_BLNH(q_shard, k_whole, v_whole, cp, cp.plan, None)
                out_whole.backward(grad_out[:, local])
                for grad in (k_whole.grad, v_whole.grad):
                    dist.all_reduce(grad)
                failures += [f"{name}/{scheme}/n_kv={n_kv}/gathered kv/{label}: max diff "
                             f"{(got - want).abs().max().item():.2e}"
                             for label, got, want in (("out", out_whole, expected[:, local]),
                                                      ("dq", q_shard.grad, q.grad[:, local]),
                                                      ("dk", k_whole.grad, k.grad[:, list(balanced)]),
                                                      ("dv", v_whole.grad, v.grad[:, list(balanced)]))
                             if not torch.allclose(got, want, rtol=1e-5, atol=1e-5)]
                # Key/value gradients reach every rank's shard: sum them over the ranks' rows.
                for label, got, want in (("out", out, expected[:, local]),
                                         ("dq", shards[0].grad, q.grad[:, local]),
                                         ("dk", shards[1].grad, k.grad[:, local]),
                                         ("dv", shards[2].grad, v.grad[:, local])):
                    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                        failures.append(f"{name}/{scheme}/n_kv={n_kv}/{label}: "
                                        f"max diff {(got - want).abs().max().item():.2e}")
        for n_kv in (2, 1):
            generator = torch.Generator().manual_seed(11)
            q, k, v, grad_out = (torch.randn(B, L, heads, H, generator=generator) for heads in (N, n_kv, n_kv, N))
            sinks = torch.randn(N, generator=generator).requires_grad_(True)
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            expected = sinks_transformed_BLNH(q, k, v, dense_keep_BLL(case), sinks)
            expected.backward(grad_out)
            shards = [t.detach()[:, local].clone().requires_grad_(True) for t in (q, k, v)]
            local_sinks = sinks.detach().clone().requires_grad_(True)
            cp = ContextParallelPlan(AttentionPlan(**case), None, tuple(local), balanced, "auto", dist.group.WORLD)
            out_BlNH, lse_BlN = context_parallel_reference_attention_BLNH(*shards, cp, cp.plan, None)
            out = out_BlNH * torch.sigmoid(lse_BlN - local_sinks).unsqueeze(-1)
            out.backward(grad_out[:, local])
            dist.all_reduce(local_sinks.grad)  # each rank's rows add to the sinks' gradient
            for label, got, want in (("out", out, expected[:, local]), ("dq", shards[0].grad, q.grad[:, local]),
                                     ("dk", shards[1].grad, k.grad[:, local]),
                                     ("dv", shards[2].grad, v.grad[:, local]), ("dsinks", local_sinks.grad, sinks.grad)):
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    failures.append(f"{name}/reference+sinks/n_kv={n_kv}/{label}: "
                                    f"max diff {(got - want).abs().max().item():.2e}")
    return failures


def test_context_parallel_attention_matches_whole_sequence_sdpa():
    results = run_on_gloo_ranks(_worker, WORLD)
    failures = [f for rank in range(WORLD) for f in results[rank]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("requested,heads,degree,expected", [
    ("auto", 16, 2, "ulysses"), ("auto", 6, 4, "allgather"), ("allgather", 16, 2, "allgather"),
])
def test_scheme_choice(requested, heads, degree, expected):
    from npu_inject.ops.cp import choose_scheme

    assert choose_scheme(requested, heads, degree) == expected
