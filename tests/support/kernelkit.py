"""Helpers shared by the kernel tests: seeded inputs, cumulative lengths, documented-signature checks."""

from __future__ import annotations

import inspect
import itertools

import torch

P = inspect.Parameter
POS, KW, NODEF = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY, P.empty


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    """Seeded normal values drawn in fp32 and cast, so every dtype sees the same numbers."""
    t = torch.randn(*shape, generator=generator(seed), dtype=torch.float32).to(dtype)
    return t.requires_grad_(requires_grad)


def cumsum(lens):
    return list(itertools.accumulate(lens))


# The gated delta rule (qwen3_5's linear attention) token by token, per document: the independent
# oracle for the chunked reference kernel and for the fla stand-in.
def recurrent_oracle(q_TNK, k_TNK, v_TNV, beta_TN, g_TN, state_BNVK, lengths, scale):
    groups = v_TNV.shape[1] // q_TNK.shape[1]
    outs, finals, start = [], [], 0
    for index, length in enumerate(lengths):
        state_NVK = state_BNVK[index]
        for t in range(start, start + length):
            q_NK = q_TNK[t].repeat_interleave(groups, 0)
            k_NK = k_TNK[t].repeat_interleave(groups, 0)
            decayed_NVK = torch.exp(g_TN[t]).view(-1, 1, 1) * state_NVK
            error_NV = v_TNV[t] - torch.einsum("nvk,nk->nv", decayed_NVK, k_NK)
            state_NVK = decayed_NVK + beta_TN[t].view(-1, 1, 1) * error_NV.unsqueeze(2) * k_NK.unsqueeze(1)
            outs.append(scale * torch.einsum("nvk,nk->nv", state_NVK, q_NK))
        finals.append(state_NVK)
        start += length
    return torch.stack(outs), torch.stack(finals)
