"""vision_pos_embed_fp32 on torchtitan's own ``_vision_pos_embed``: no bfloat16 reaches the grid sampler.

CANN's aclnnGridSampler2D takes no bfloat16 on A2/A3 (its document). Expected values come from
torch's float32 ``F.grid_sample`` on the table, written here, never from the patch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from testkit import clean_env
from npu_inject import runtime


class GridSamplerDtypes(TorchDispatchMode):
    """The input dtypes grid_sampler_2d (forward and backward) is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.grid_sampler_2d, torch.ops.aten.grid_sampler_2d_backward):
            self.seen += [a.dtype for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


@pytest.fixture
def vision_encoder():
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="vision_pos_embed_fp32"))
    module = importlib.import_module("torchtitan.models.muse_glimmer.vision_encoder")
    assert rt.report.patches["vision_pos_embed_fp32"].state == "applied", rt.report.patches["vision_pos_embed_fp32"].reason
    return module


def _table(dtype):
    values = torch.randn(4 * 6, 8, generator=torch.Generator().manual_seed(0))
    return values.to(dtype).requires_grad_()


def _expected(table_f32, grid_h, grid_w):
    pos_emb = table_f32.view(4, 6, 8).permute(2, 0, 1).unsqueeze(0)
    ys = torch.linspace(-1 + 1 / grid_h, 1 - 1 / grid_h, grid_h)
    xs = torch.linspace(-1 + 1 / grid_w, 1 - 1 / grid_w, grid_w)
    grid = torch.stack(torch.meshgrid(ys, xs, indexing="xy"), dim=-1).reshape(1, 1, -1, 2)
    return F.grid_sample(pos_emb, grid, mode="bilinear", align_corners=False)[0, :, 0, :].T


def test_bf16_table_resampled_in_float32_and_returned_in_bf16(vision_encoder):
    table = _table(torch.bfloat16)
    with GridSamplerDtypes() as mode:
        out = vision_encoder._vision_pos_embed(table, grid_h=3, grid_w=5, src_grid_h=4, src_grid_w=6,
                                               latent_dim=8, device=torch.device("cpu"))
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and out.shape == (15, 8)
    assert set(mode.seen) == {torch.float32}  # what CANN's grid sampler takes on A2/A3
    reference = table.detach().float().requires_grad_()
    expected = _expected(reference, 3, 5)
    expected.sum().backward()
    torch.testing.assert_close(out, expected.to(torch.bfloat16))
    torch.testing.assert_close(table.grad, reference.grad.to(torch.bfloat16))


def test_float32_table_goes_through_unchanged(vision_encoder):
    table = _table(torch.float32)
    with GridSamplerDtypes() as mode:
        out = vision_encoder._vision_pos_embed(table, grid_h=2, grid_w=2, src_grid_h=4, src_grid_w=6,
                                               latent_dim=8, device=torch.device("cpu"))
    assert set(mode.seen) == {torch.float32}
    torch.testing.assert_close(out, _expected(table.detach(), 2, 2))
