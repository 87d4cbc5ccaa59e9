"""TEST ONLY: attention on plain SDPA with dense masks, the independent baseline for loss parity

Test-only third-party patch: torchtitan attention on plain PyTorch SDPA with dense masks.

The independent baseline for loss parity: it shares no code with npu_inject's
attention patch or reference kernels. Masks are torchtitan's own mask mods (or
its varlen document offsets) evaluated densely; attention is
torch.nn.functional.scaled_dot_product_attention. Joins through a user registry
(reference_registry.json) with this directory on PYTHONPATH.
"""

from __future__ import annotations

TARGETS = (
    "torchtitan.models.common.decoder:Decoder._create_flex_attention_mask",
    "torchtitan.models.common.attention:FlexAttention.forward",
    "torchtitan.models.common.attention:VarlenAttention.forward",
)


class DenseKeepMask:
    def __init__(self, keep_BLL):
        self.keep_BLL = keep_BLL


def _sdpa_BLNH(q_BLNH, k_BLNH, v_BLNH, keep_BLL, scale):
    import torch.nn.functional as F

    groups = q_BLNH.shape[2] // k_BLNH.shape[2]
    q = q_BLNH.transpose(1, 2)
    k = k_BLNH.transpose(1, 2).repeat_interleave(groups, dim=1)
    v = v_BLNH.transpose(1, 2).repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep_BLL.unsqueeze(1), scale=scale).transpose(1, 2)


def _dense_from_mask_mods(positions_BL, mask_mods):
    import torch

    B, L = positions_BL.shape
    b = torch.arange(B, device=positions_BL.device).view(B, 1, 1)
    q_idx = torch.arange(L, device=positions_BL.device).view(1, L, 1)
    kv_idx = torch.arange(L, device=positions_BL.device).view(1, 1, L)
    keep = torch.ones(B, L, L, dtype=torch.bool, device=positions_BL.device)
    for mask_mod in mask_mods:
        keep = keep & mask_mod(b, None, q_idx, kv_idx)
    return keep


def apply(ctx):
    import torch

    def create_mask(original, decoder, positions, attn_config, mask_mods):
        return DenseKeepMask(_dense_from_mask_mods(positions, mask_mods))

    def flex_forward(original, flex, q, k, v, *, attention_masks, score_mod=None, scale=None,
                     out_transform=None, **kwargs):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("sdpa_reference_attention: score_mod/out_transform are not needed by the tests")
        keep_BLL = getattr(attention_masks, "keep_BLL", None)
        if keep_BLL is None:  # a BlockMask the model built itself (muse_glimmer): its mask_mod, densely
            shape_BL = torch.zeros(q.shape[:2], dtype=torch.long, device=q.device)
            keep_BLL = _dense_from_mask_mods(shape_BL, [attention_masks.mask_mod])
        return _sdpa_BLNH(q, k, v, keep_BLL, scale)

    def varlen_forward(original, varlen, q, k, v, *, attention_masks, scale=None, **kwargs):
        B, L = q.shape[:2]
        cu = attention_masks.cu_seq_q
        token = torch.arange(B * L, device=q.device)
        document_BL = (torch.searchsorted(cu, token, right=True) - 1).view(B, L)
        keep = document_BL.unsqueeze(2) == document_BL.unsqueeze(1)
        left, right = varlen.window_size
        q_idx, kv_idx = torch.arange(L, device=q.device).view(L, 1), torch.arange(L, device=q.device).view(1, L)
        if right == 0:
            keep = keep & (kv_idx <= q_idx)
        if left >= 0:
            keep = keep & (q_idx - kv_idx <= left)
        return _sdpa_BLNH(q, k, v, keep, scale)

    ctx.wrap("torchtitan.models.common.decoder:Decoder._create_flex_attention_mask", create_mask)
    ctx.wrap("torchtitan.models.common.attention:FlexAttention.forward", flex_forward)
    ctx.wrap("torchtitan.models.common.attention:VarlenAttention.forward", varlen_forward)
