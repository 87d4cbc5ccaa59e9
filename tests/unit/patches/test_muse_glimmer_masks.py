"""muse_glimmer_masks' vision encoder masks against upstream's own create_block_mask.

The per-image mask mod becomes the bidirectional plan whose dense mask equals upstream's on
every real patch; any other mask mod (the windowed one) gets exactly upstream's BlockMask,
built eagerly (compiling it fails on the CPU with torch 2.14.1 and has no inductor backend on
the simulated npu), and the fallback is reported.
"""

from __future__ import annotations

from testkit import REPO, clean_env, run_python

CHECK = """
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import torchtitan.models.muse_glimmer.model  # the patch's trigger
import torchtitan.models.muse_glimmer.vision_encoder as vision_encoder
from torchtitan.models.common.vision_encoder import get_vision_block_mask_mod
from npu_inject import runtime
from npu_inject.ops.attention import AttentionPlan, plan_keep_mask

rt = runtime.current()
num_patches, P = torch.tensor([5, 8, 3]), 8
vision_mask = get_vision_block_mask_mod(num_patches)
plan = vision_encoder.compiled_create_block_mask(vision_mask, 3, None, P, P, device="cpu")
assert plan == AttentionPlan(causal=False, document_ends=(5, 8, 16, 19, 24)), plan
# On every real patch (query and key both real) the plan keeps exactly what upstream's mask keeps.
want = create_mask(vision_mask, 3, None, P, P, device="cpu")[:, 0]
got = plan_keep_mask(plan, 3, P, P, torch.device("cpu"))[:, 0]
real = torch.arange(P).view(1, P) < num_patches.view(3, 1)
both = real.unsqueeze(2) & real.unsqueeze(1)
assert torch.equal(got[both], want[both]) and not got[real.unsqueeze(2) & ~real.unsqueeze(1)].any()
print("VISION ok")

win_id = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]] * 3)
def windowed(b, h, q_idx, kv_idx):
    valid = (q_idx < num_patches[b]) & (kv_idx < num_patches[b])
    return valid & (win_id[b, q_idx] == win_id[b, kv_idx])
block_mask = vision_encoder.compiled_create_block_mask(windowed, 3, None, 4, 4, device="cpu")
upstream = create_block_mask(windowed, 3, None, 4, 4, device="cpu")
assert torch.equal(block_mask.to_dense(), upstream.to_dense())
print("WINDOWED ok", type(block_mask).__name__)
report = rt.report.patches["muse_glimmer_masks"]
print("STATE", report.state, len(report.fallbacks))
rt.revert_all()
from torchtitan.models.common import vision_encoder as common_vision_encoder
print("REVERTED", vision_encoder.compiled_create_block_mask is common_vision_encoder.compiled_create_block_mask)
"""


def test_vision_masks_are_upstreams_without_compiling_them():
    result = run_python(CHECK, env=clean_env(TORCHTITAN_NPU="cpu"), cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for line in ("VISION ok", "WINDOWED ok BlockMask", "STATE applied 1", "REVERTED True"):
        assert line in result.stdout, result.stdout + result.stderr[-2000:]
