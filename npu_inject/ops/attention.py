"""torchtitan's attention cases, expressed as ``npu_fusion_attention`` calls.

Shape suffixes follow torchtitan: B batch, L sequence, N heads, H head dim,
T packed tokens. Inputs arrive as (B, L, N, H), which is the kernel's BSND
layout, so plain causal attention needs no transpose; document-packed batches
use the TND layout with cumulative per-document end offsets.

Masks are never built per call: the causal and band sparse modes (2, 3, 4) take
torch_npu's compressed 2048x2048 upper-triangular mask, made once per device.

Packed documents run on ``npu_fusion_attention_v3``, which takes the cumulative
document ends as a CPU int64 tensor (torch_npu reads it on the host): under
torch.compile the boundaries are then graph data, not host ints that dynamo would
specialize on (one recompile per new document count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from npu_inject.ops import kernels, planner_hooks, spmd_typing
from npu_inject.ops.host_reads import host_copy

COMPRESSED_MASK_SIZE = 2048
SPARSE_LEFT_UP_CAUSAL, SPARSE_RIGHT_DOWN_CAUSAL, SPARSE_BAND = 2, 3, 4

_compressed_masks: dict[torch.device, torch.Tensor] = {}


# A constant of the compiled graph: otherwise dynamo guards on the cache's contents, and the block
# traced before the first mask existed recompiles once the cache holds it.
@torch.compiler.assume_constant_result
def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 mask sparse modes 2/3/4 take (True = masked out), cached per device."""
    mask = _compressed_masks.get(device)
    if mask is None:
        ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
        mask = _compressed_masks[device] = torch.triu(ones, diagonal=1)
    return mask


@dataclass(frozen=True)
class AttentionPlan:
    """Which kernel call a torchtitan mask amounts to.

    ``document_ends`` are cumulative end offsets of every packed document over the
    flattened B*L tokens (TND's actual_seq_qlen) as host ints, for context parallel and
    the dense fallback mask; ``document_ends_tensor`` the same ends as a 1-D CPU int64
    tensor, what the kernel takes. A plan built for a compiled block carries the
    tensor (alone for varlen): code there reads only the tensor, so dynamo guards on
    its shape instead of every offset. Neither: one sequence per row.
    ``window`` is the sliding-window size in tokens including the query itself
    (None: unbounded). ``causal`` False means full bidirectional attention.
    """

    causal: bool = True
    window: int | None = None
    document_ends: tuple[int, ...] | None = None
    # Left out of equality and hashing (a tensor has neither): context parallel caches by plan.
    document_ends_tensor: torch.Tensor | None = field(default=None, compare=False)

    @property
    def packed(self) -> bool:
        """Packed documents (TND). Tests the tensor first, so a plan carrying it is never read for host ends."""
        return self.document_ends_tensor is not None or self.document_ends is not None

    def ends_tensor(self) -> torch.Tensor:
        """The document ends as the kernel takes them (built from the host ends when the plan has no tensor)."""
        if self.document_ends_tensor is not None:
            return self.document_ends_tensor
        return torch.tensor(self.document_ends, dtype=torch.int64, device="cpu")


def document_ends_from_positions(positions_BL: torch.Tensor) -> tuple[int, ...]:
    """Cumulative document ends over B*L tokens; documents start where positions reset to 0.

    Each row starts a document, as torchtitan's packed-document flex masks behave. The kernel takes the
    lengths on the host, so the positions are read there: one copy per forward, shared with RoPE's
    bounds check (:mod:`npu_inject.ops.host_reads`), and computed on the host (no device launches).
    ``npu-inject plan`` answers from the positions' shape instead (:mod:`npu_inject.ops.planner_hooks`).
    """
    if planner_hooks.document_ends is not None:
        return planner_hooks.document_ends(positions_BL)
    starts_BL = host_copy(positions_BL) == 0
    starts_BL[:, 0] = True
    starts = starts_BL.flatten().nonzero().flatten().tolist()
    return tuple(starts[1:]) + (positions_BL.numel(),)


def vision_document_ends(num_patches: list[int], max_num_patch: int) -> tuple[int, ...]:
    """Cumulative TND document ends over N x max_num_patch tokens: each image's patches, then its padding."""
    ends: list[int] = []
    for row, count in enumerate(num_patches):
        if not 0 < count <= max_num_patch:
            raise ValueError(f"vision encoder: image {row} has {count} patches; expected 1..{max_num_patch} "
                             "(grid_thw's t*h*w within the padded patch count)")
        ends.append(row * max_num_patch + count)
        if count < max_num_patch:
            ends.append((row + 1) * max_num_patch)
    return tuple(ends)


def document_plan(causal: bool, window: int | None, document_ends: tuple[int, ...]) -> AttentionPlan:
    """A packed-document plan carrying its ends both ways (host ints and the kernel's CPU tensor, no sync)."""
    ends_T = torch.tensor(document_ends, dtype=torch.int64, device="cpu")
    # The document count changes every batch: a compiled block takes it as dynamic from its first
    # trace, instead of compiling static first and again at the next count (which also left one
    # rank recompiling while the other waited in a collective).
    torch._dynamo.maybe_mark_dynamic(ends_T, 0)
    return AttentionPlan(causal=causal, window=window, document_ends=document_ends, document_ends_tensor=ends_T)


def vision_plan(mask_mod, vision_mask_code, B: int, Q_LEN: int, KV_LEN: int, model: str) -> AttentionPlan | None:
    """The bidirectional plan for torchtitan's per-image vision mask (``get_vision_block_mask_mod``, whose
    code object is ``vision_mask_code``): one document per image's patches, one per row's padding.
    None for any other mask mod. One host read of the patch counts per encoder forward."""
    if getattr(mask_mod, "__code__", None) is not vision_mask_code or Q_LEN != KV_LEN:
        return None
    cells = dict(zip(mask_mod.__code__.co_freevars, mask_mod.__closure__ or ()))
    num_patches = cells["num_patches"].cell_contents.tolist()
    if len(num_patches) != B:
        raise ValueError(f"{model} vision encoder: {len(num_patches)} patch counts for a batch of {B} images")
    # With the ends as a tensor too, a compiled encoder does not specialise on the patch counts.
    return document_plan(causal=False, window=None, document_ends=vision_document_ends(num_patches, Q_LEN))


def _sparse_arguments(plan: AttentionPlan) -> dict:
    if not plan.causal:
        return {"sparse_mode": 0, "atten_mask": None}
    if plan.window is None:
        # Equal query/key lengths: left-up and right-down causal coincide; TND needs
        # right-down (mode 3) so each packed document is causal on its own.
        mode = SPARSE_RIGHT_DOWN_CAUSAL if plan.packed else SPARSE_LEFT_UP_CAUSAL
        return {"sparse_mode": mode}
    return {"sparse_mode": SPARSE_BAND, "pre_tockens": plan.window - 1, "next_tockens": 0}


def fusion_attention_BLNH(
    q_BLNH: torch.Tensor,
    k_BLNH: torch.Tensor,
    v_BLNH: torch.Tensor,
    plan: AttentionPlan,
    scale: float | None,
    return_lse: bool = False,
    sink_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention output (B, L, N, H) and, when ``return_lse``, log-sum-exp (B, L, N) through npu_fusion_attention.

    ``sink_N``: one more logit per query head in each row's softmax, its column dropped before value
    (gpt_oss's attention sinks; the kernel's ``sink``, differentiable): the output is the sink-less one
    times ``sigmoid(lse - sink_N)``. Cast to float32, the kernel's dtype for it.

    The log-sum-exp comes from the kernel's softmax statistics, which carry no
    gradient (torch_npu returns them for its own backward): use it for values, not
    for anything that must be differentiated. It costs two launches (a log and an add) per call, so only
    callers that read it ask for it (None otherwise). Key/value may carry fewer heads than the query (GQA):
    the kernel takes them as they are. Inputs keep their dtype: the kernel takes fp16, bf16 and fp32.
    """
    # Under spmd_types type checking the kernel is a typing boundary, as upstream's attention kernels:
    # its host metadata (document ends, compressed mask) goes unchecked, the outputs take q's type.
    with spmd_typing.opaque_kernel():
        out_BLNH, lse_BLN = _fusion_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, plan, scale, return_lse, sink_N)
    out_BLNH = spmd_typing.type_like(out_BLNH, q_BLNH)
    return out_BLNH, None if lse_BLN is None else spmd_typing.type_like(lse_BLN, q_BLNH, keep_dims=3)


def _fusion_attention_BLNH(q_BLNH, k_BLNH, v_BLNH, plan: AttentionPlan, scale: float | None, return_lse: bool,
                           sink_N: torch.Tensor | None = None):
    B, L, N, H = q_BLNH.shape
    value_head_dim = v_BLNH.shape[-1]
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    arguments = {"scale": scale, "atten_mask": compressed_causal_mask(q_BLNH.device)}
    arguments.update(_sparse_arguments(plan))
    if sink_N is not None:  # only then: torch_npu picks the sink kernels (aclnnFlashAttentionScoreV3, ...) for it
        arguments["sink"] = sink_N.float()
    ops = kernels()
    if not plan.packed:
        out_BLNH, softmax_max_BNL8, softmax_sum_BNL8, *_ = ops.npu_fusion_attention(
            q_BLNH, k_BLNH, v_BLNH, N, "BSND", **arguments
        )
        if not return_lse:
            return out_BLNH, None
        lse_BLN = (softmax_max_BNL8[..., 0] + softmax_sum_BNL8[..., 0].log()).transpose(1, 2)
    else:
        T = B * L
        ends = plan.ends_tensor()
        out_TNH, softmax_max_TN8, softmax_sum_TN8, *_ = ops.npu_fusion_attention_v3(
            q_BLNH.reshape(T, N, H),
            k_BLNH.reshape(T, k_BLNH.shape[2], H),
            v_BLNH.reshape(T, v_BLNH.shape[2], value_head_dim),
            N,
            "TND",
            actual_seq_qlen=ends,
            actual_seq_kvlen=ends,
            # Ask for token-major softmax statistics: the default TND order is head-major.
            softmax_layout="TND",
            **arguments,
        )
        out_BLNH = out_TNH.view(B, L, N, value_head_dim)
        if not return_lse:
            return out_BLNH, None
        lse_BLN = (softmax_max_TN8[..., 0] + softmax_sum_TN8[..., 0].log()).view(B, L, N)
    return out_BLNH, lse_BLN


def reference_attention_BLNH(
    q_BLNH: torch.Tensor,
    k_BLNH: torch.Tensor,
    v_BLNH: torch.Tensor,
    keep_BNLL: torch.Tensor,
    scale: float | None,
    score_mod=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback for masks/score_mods the kernel cannot express: explicit scores and softmax.

    ``keep_BNLL`` is a dense boolean mask (True = attend), broadcastable over heads.
    """
    B, L, N, H = q_BLNH.shape
    q_BNLH = q_BLNH.transpose(1, 2).float()
    groups = N // k_BLNH.shape[2]
    k_BNLH = k_BLNH.transpose(1, 2).float().repeat_interleave(groups, dim=1)
    v_BNLH = v_BLNH.transpose(1, 2).float().repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    scores_BNLL = (q_BNLH @ k_BNLH.transpose(-1, -2)) * scale
    if score_mod is not None:
        index = lambda size, dim: torch.arange(size, device=q_BLNH.device).view(  # noqa: E731
            [size if d == dim else 1 for d in range(4)]
        )
        scores_BNLL = score_mod(scores_BNLL, index(B, 0), index(N, 1), index(L, 2), index(k_BLNH.shape[1], 3))
    scores_BNLL = scores_BNLL.masked_fill(~keep_BNLL, float("-inf"))
    lse_BNL = torch.logsumexp(scores_BNLL, dim=-1)
    probs_BNLL = torch.exp(scores_BNLL - lse_BNL.unsqueeze(-1)).nan_to_num(0.0)
    out_BNLH = probs_BNLL @ v_BNLH
    return out_BNLH.transpose(1, 2).to(q_BLNH.dtype), lse_BNL.transpose(1, 2)


def plan_keep_mask(plan: AttentionPlan, B: int, L: int, S: int, device: torch.device) -> torch.Tensor:
    """Dense (B, 1, L, S) boolean mask (True = attend) of a plan, for the reference fallback only."""
    q_idx = torch.arange(L, device=device).view(L, 1)
    kv_idx = torch.arange(S, device=device).view(1, S)
    keep_LS = torch.ones(L, S, dtype=torch.bool, device=device)
    if plan.causal:
        keep_LS &= kv_idx <= q_idx
    if plan.window is not None:
        keep_LS &= q_idx - kv_idx < plan.window
    keep_BLS = keep_LS.expand(B, L, S).clone()
    if plan.packed:
        # A token's document is the number of ends at or before it (tensor ops: no host read).
        ends = plan.ends_tensor().to(device)
        document_BL = torch.bucketize(torch.arange(B * L, device=device), ends, right=True).view(B, L)
        keep_BLS &= document_BL.unsqueeze(2) == document_BL.unsqueeze(1)
    return keep_BLS.unsqueeze(1)
