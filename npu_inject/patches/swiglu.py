"""The SwiGLU of the dense FFN and of the routed experts as one npu_swiglu; w1 and w3 stay separate parameters.

torchtitan computes ``F.silu(w1(x)) * w3(x)`` in ``FeedForward.forward``
(``models/common/feed_forward.py``) and between the grouped matmuls of
``GroupedExperts.forward`` (``models/common/moe.py``): three small ops per FFN on an
NPU. This patch keeps the projections as upstream computes them -- w1 and w3 stay
separate parameters, so checkpoints are unchanged, and the experts' matmuls still go
through ``GroupedExperts._grouped_mm`` (npu_grouped_matmul with moe_dispatch) -- and
joins silu and the product into one ``npu_swiglu`` per FFN (glue:
:mod:`npu_inject.ops.swiglu`). The experts keep upstream's bf16 casts.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.feed_forward:FeedForward.forward",
    "torchtitan.models.common.moe:GroupedExperts.forward",
)


def apply(ctx: PatchContext) -> None:
    import spmd_types as spmd
    import torch
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.spmd_types import spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

    from npu_inject.ops.swiglu import swiglu

    def feed_forward(original, ffn, x):
        return ffn.w2(swiglu(ffn.w1(x), ffn.w3(x)))

    def grouped_experts(original, experts, x_RD, num_tokens_per_expert_E):
        w1_EFD, w2_EDF, w3_EFD = experts.w1_EFD, experts.w2_EDF, experts.w3_EFD
        if isinstance(w1_EFD, DTensor):  # as upstream: plain local shards for dynamic-shape inputs
            w1_EFD, w2_EDF, w3_EFD = w1_EFD.to_local(), w2_EDF.to_local(), w3_EFD.to_local()
        # int32 as upstream, for torch._grouped_mm; int64 where moe_dispatch's grouped matmul says so
        # (CANN's group_list), which saves a cast per grouped matmul.
        offsets_dtype = getattr(experts._grouped_mm, "npu_inject_offsets_dtype", torch.int32)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=offsets_dtype)
        if get_spmd_backend() == "spmd_types" and spmd.is_type_checking() and spmd_mesh_size("ep") == 1:
            # Upstream's typing of the offsets without EP (P on dp/cp cannot meet the V weights).
            for axis in ("dp", "cp"):
                spmd.mutate_type(offsets_E, axis, src=spmd.P, dst=spmd.V)
        x_bf16_RD = x_RD.bfloat16()
        gate_RF = experts._grouped_mm(A=x_bf16_RD, B_t=w1_EFD.bfloat16().transpose(-2, -1), offs=offsets_E)
        up_RF = experts._grouped_mm(A=x_bf16_RD, B_t=w3_EFD.bfloat16().transpose(-2, -1), offs=offsets_E)
        # (gate, up) stacked first: contiguous gradients for the grouped matmuls' backward, whose contiguity
        # torch.compile cannot check for a data-dependent row count (expert parallelism's R).
        h_RF = swiglu(gate_RF, up_RF, gate_up_dim=0)
        return experts._grouped_mm(A=h_RF, B_t=w2_EDF.bfloat16().transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    ctx.wrap("FeedForward.forward", feed_forward)
    ctx.wrap("GroupedExperts.forward", grouped_experts)
