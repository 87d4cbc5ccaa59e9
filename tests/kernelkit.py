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
