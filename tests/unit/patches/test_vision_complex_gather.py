"""vision_complex_gather on torchtitan's own ``_vision_token_permute``: no complex tensor reaches gather.

CANN's aclnnGather lists no complex dtype (its document). Expected values come from indexing the
complex tensor per image, written here, never from the patch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from testkit import clean_env
from npu_inject import runtime

PATCH_ID = "vision_complex_gather"


class GatherDtypes(TorchDispatchMode):
    """The dtypes gather and its backward's scatter_add are called with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.gather, torch.ops.aten.scatter_add, torch.ops.aten.scatter_add_):
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def vision_encoder():
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=PATCH_ID))
    module = importlib.import_module("torchtitan.models.muse_glimmer.vision_encoder")
    assert rt.report.patches[PATCH_ID].state == "applied", rt.report.patches[PATCH_ID].reason
    return module


def test_complex_cache_permuted_as_real_pairs_values_and_gradient(vision_encoder):
    generator = torch.Generator().manual_seed(0)
    cache_NPHC = torch.randn(2, 5, 1, 3, dtype=torch.complex64, generator=generator).requires_grad_()
    perm_NP = torch.stack([torch.randperm(5, generator=generator) for _ in range(2)])
    with GatherDtypes() as mode:
        out = vision_encoder._vision_token_permute(cache_NPHC, perm_NP)
        (out.real * 2 + out.imag).sum().backward()
    assert out.dtype == torch.complex64 and mode.seen == {torch.float32}
    expected = torch.stack([cache_NPHC.detach()[n, perm_NP[n]] for n in range(2)])
    torch.testing.assert_close(out, expected)
    # each element is picked once, so its gradient is d/dz of 2 re(z) + im(z): 2 + 1j
    torch.testing.assert_close(cache_NPHC.grad, torch.full_like(cache_NPHC, 2 + 1j).detach())


def test_real_tensor_goes_through_unchanged(vision_encoder):
    x_NPD = torch.randn(2, 4, 6)
    perm_NP = torch.tensor([[3, 0, 1, 2], [1, 2, 3, 0]])
    with GatherDtypes() as mode:
        out = vision_encoder._vision_token_permute(x_NPD, perm_NP)
    assert mode.seen == {torch.float32}
    torch.testing.assert_close(out, torch.stack([x_NPD[n, perm_NP[n]] for n in range(2)]))
