"""qwen3_5_masks against independent PyTorch math, on the rehearsal's reference npu_fusion_attention.

The expected values never go through npu_inject: masks are torchtitan's own mask mods
(the ones ``Qwen35Model.get_attention_masks`` and the vision encoder build), attention
is torch's flex_attention (forward; it has no CPU backward) with upstream's BlockMask,
and SDPA for outputs and gradients -- per image on its real patches for the vision
encoder, with the dense mask of the decoder's mask mods for the full-attention layers.
A fresh interpreter: the fla stand-in (patch gated_delta_net) must serve qwen3_5's
imports before torchtitan's model module loads.
"""

from __future__ import annotations

import pytest

from npu_inject.ops.attention import vision_document_ends
from testkit import REPO, clean_env, run_python

CHECK = """
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask, flex_attention

import torchtitan.models.qwen3_5.vision_encoder as vision_encoder
from torchtitan.models.common import attention
from torchtitan.models.common.vision_encoder import get_vision_block_mask_mod
from torchtitan.models.qwen3_5 import model_registry
from npu_inject import runtime
from npu_inject.ops.attention import AttentionPlan

rt = runtime.current()
flex = attention.FlexAttention.Config().build()  # its forward is the attention patch's
generator = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=generator, requires_grad=True)


def close(got, want, what, atol=2e-6, rtol=1e-5):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def grads(out, inputs, weights):
    return torch.autograd.grad(out, inputs, weights)


# Full-attention layers: the debug model's own get_attention_masks on packed documents.
with torch.device("meta"):
    model = model_registry("debugmodel").model.build()
B, L, N, H = 2, 24, 4, 8
positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(B, 1)
positions[1] = torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)])
masks = model.get_attention_masks(positions)
plan = masks["quadratic_attention"]
assert isinstance(plan, AttentionPlan), type(plan)
upstream = attention.create_varlen_metadata_for_document(positions, include_host_offsets=True)
assert masks["deltanet"].cu_seq_q_host == upstream.cu_seq_q_host and torch.equal(masks["deltanet"].cu_seq_q,
                                                                                 upstream.cu_seq_q)
mask_mod = and_masks(attention.get_causal_mask_mod(),
                     attention.get_efficient_causal_mask_mod_for_packed_document(positions))
q, k, v = rand(B, L, N, H), rand(B, L, N, H), rand(B, L, N, H)
out = flex(q, k, v, attention_masks=plan)
block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu")
want_flex = flex_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)), block_mask=block_mask).transpose(1, 2)
close(out, want_flex, "decoder vs flex_attention")
keep = create_mask(mask_mod, B, None, L, L, device="cpu")
want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=keep).transpose(1, 2)
close(out, want, "decoder vs sdpa")
weights = torch.randn_like(out)
for got, expected, name in zip(grads(out, (q, k, v), weights), grads(want, (q, k, v), weights), "qkv"):
    close(got, expected, f"decoder d{name}", atol=1e-5, rtol=1e-4)
print("DECODER ok", plan)

# Vision encoder: images padded to the batch's largest patch count.
num_patches, P = torch.tensor([5, 8, 3]), 8
vision_mask = get_vision_block_mask_mod(num_patches)
plan = vision_encoder.compiled_create_block_mask(vision_mask, 3, None, P, P, device="cpu")
assert plan == AttentionPlan(causal=False, document_ends=(5, 8, 16, 19, 24)), plan
q, k, v = rand(3, P, N, H), rand(3, P, N, H), rand(3, P, N, H)
out = flex(q, k, v, attention_masks=plan)
block_mask = create_block_mask(vision_mask, 3, None, P, P, device="cpu")
want_flex = flex_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)), block_mask=block_mask).transpose(1, 2)
real = (torch.arange(P).view(1, P) < num_patches.view(3, 1))  # (images, patches): what the merger's outputs keep
close(out[real], want_flex[real], "vision vs flex_attention (real patches)")
weights = torch.randn_like(out) * real.view(3, P, 1, 1)  # padded outputs are never read
got = grads(out, (q, k, v), weights)
for image, count in enumerate(num_patches.tolist()):
    sl = [t[image:image + 1, :count].transpose(1, 2) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*sl).transpose(1, 2)
    close(out[image:image + 1, :count], want, f"vision image {image} vs sdpa")
    for g, t, name in zip(got, (q, k, v), "qkv"):
        expected = torch.autograd.grad(want, t, weights[image:image + 1, :count], retain_graph=True)[0]
        close(g[image:image + 1], expected[image:image + 1], f"vision image {image} d{name}", atol=1e-5, rtol=1e-4)
print("VISION ok", plan)

report = rt.report.patches
print("STATE", report["qwen3_5_masks"].state, report["attention"].fallbacks)
rt.revert_all()
from torchtitan.models.common import vision_encoder as common_vision_encoder
print("REVERTED", vision_encoder.compiled_create_block_mask is common_vision_encoder.compiled_create_block_mask)
"""


def test_qwen3_5_masks_run_on_the_fused_kernel_like_upstream_attention():
    result = run_python(CHECK, env=clean_env(TORCHTITAN_NPU="cpu"), cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for line in ("DECODER ok", "VISION ok", "STATE applied []", "REVERTED True"):
        assert line in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("counts,P,ends", [
    ([4, 4], 4, (4, 8)),  # no padding: one document per image
    ([1, 3], 4, (1, 4, 7, 8)),  # each image, then its row's padding
])
def test_vision_documents_are_each_image_then_its_padding(counts, P, ends):
    assert vision_document_ends(counts, P) == ends


@pytest.mark.parametrize("counts", [[0, 4], [5, 4]])
def test_vision_patch_counts_outside_the_padded_length_are_named(counts):
    with pytest.raises(ValueError, match="expected 1..4"):
        vision_document_ends(counts, 4)
