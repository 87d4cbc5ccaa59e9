"""MoE experts on npu_grouped_matmul, token reorder/combine on npu_moe_token_permute/unpermute, uneven EP all-to-all.

torchtitan runs routed experts through ``torch._grouped_mm`` (CUDA; on
CPU bf16-centric with 16-byte stride alignment) and moves tokens between
expert-parallel ranks with spmd_types' list ``all_to_all``, which needs equal
chunk sizes on gloo. This patch:

* replaces ``GroupedExperts._grouped_mm`` (upstream's seam for other grouped
  GEMMs): ``npu_grouped_matmul`` split along M, ``group_list`` = the cumulative
  token offsets (``group_list_type=0``), any float dtype, empty experts allowed.
  Gradients are grouped-matmul kernel calls too (dx along M, dweight along K,
  on the NPU and in the rehearsal's reference kernels alike); a kernel provider
  without K grouping differentiates its own forward instead, which the report
  lists as a fallback;
* replaces the local token reorder and combine (``LocalTokenDispatcher._local_reorder``,
  ``.combine``) and the all-to-all dispatcher's expert-major ``_permute`` /
  ``_unpermute`` and ``combine``: ``npu_moe_token_permute`` /
  ``npu_moe_token_unpermute`` (scores applied and top-k rows summed in the kernel);
* replaces the all-to-all dispatcher's token exchanges: an uneven, differentiable
  ``all_to_all_single`` on the expert-parallel process group (HCCL on the NPU,
  gloo in the rehearsal), as upstream does when spmd_types is not the backend.

Nothing on this path needs triton. Dispatch metadata keeps upstream's meaning,
so subclasses overriding parts of the dispatchers (TorchAO's padded permute)
keep working.
"""

from __future__ import annotations

import functools

from torch.distributed._functional_collectives import all_to_all_single
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from npu_inject.ops import moe as moe_ops
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.moe:GroupedExperts._grouped_mm",
    "torchtitan.models.common.token_dispatcher:LocalTokenDispatcher._local_reorder",
    "torchtitan.models.common.token_dispatcher:LocalTokenDispatcher.combine",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._dispatch_token_exchange",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._permute",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._unpermute",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._combine_token_exchange",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher.combine",
)


def apply(ctx: PatchContext) -> None:
    grouped_mm_installed = ctx.wrap("GroupedExperts._grouped_mm", functools.partial(grouped_mm, ctx))
    # Read by the swiglu patch, which then makes the expert offsets in the kernel's dtype (one cast
    # fewer per grouped matmul); upstream's torch._grouped_mm, unmarked, keeps int32.
    grouped_mm_installed.npu_inject_offsets_dtype = moe_ops.GROUP_LIST_DTYPE
    ctx.wrap("LocalTokenDispatcher._local_reorder", local_reorder)
    ctx.wrap("LocalTokenDispatcher.combine", local_combine)
    ctx.wrap("AllToAllTokenDispatcher._dispatch_token_exchange", dispatch_exchange)
    ctx.wrap("AllToAllTokenDispatcher._permute", permute)
    ctx.wrap("AllToAllTokenDispatcher._unpermute", unpermute)
    ctx.wrap("AllToAllTokenDispatcher._combine_token_exchange", combine_exchange)
    ctx.wrap("AllToAllTokenDispatcher.combine", all_to_all_combine)


# -- GroupedExperts._grouped_mm: npu_grouped_matmul along M -------------------------------------

def grouped_mm(ctx, original, experts, *, A, B_t, offs):
    if offs is None or A.dim() != 2 or B_t.dim() != 3:
        ctx.fallback(
            f"_grouped_mm with A {A.dim()}-D, B_t {B_t.dim()}-D, offs {'None' if offs is None else 'given'} "
            "runs on torch._grouped_mm (the patch maps 2-D A, 3-D B_t and offsets)"
        )
        return original(experts, A=A, B_t=B_t, offs=offs)
    kernel_backward = moe_ops.kernel_backward_available(A.device, A.dtype)
    if not kernel_backward:
        ctx.fallback(
            "the kernel provider has no K-axis grouped matmul (group_type=2): expert weight "
            "gradients come from autograd through its forward instead of grouped-matmul kernel calls"
        )
    return moe_ops.grouped_matmul_RO(A, B_t, offs, kernel_backward=kernel_backward)


# -- LocalTokenDispatcher: reorder and combine on the permute/unpermute kernels ------------------

def local_reorder(original, dispatcher, x_TD, topk_scores_TK, topk_expert_ids_TK):
    if topk_expert_ids_TK.shape[-1] != dispatcher.top_k:
        raise ValueError(
            f"moe_dispatch: topk_expert_ids_TK has {topk_expert_ids_TK.shape[-1]} experts per token; "
            f"the dispatcher's top_k is {dispatcher.top_k}"
        )
    return moe_ops.permute_tokens_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK)


def local_combine(original, dispatcher, routed_output_RD, metadata, x_TD):
    return moe_ops.combine_by_token(
        routed_output_RD,
        metadata.token_indices_experts_sorted_N,
        metadata.topk_scores_experts_sorted_N,
        x_TD,
    )


# -- AllToAllTokenDispatcher: uneven exchanges, expert-major permutation, combine ----------------

def _spmd_type_checking() -> bool:
    import spmd_types as spmd
    from torchtitan.distributed.utils import get_spmd_backend

    return get_spmd_backend() == "spmd_types" and spmd.is_type_checking()


def exchange(rows_ND, pg, output_splits, input_splits):
    if not _spmd_type_checking():
        return all_to_all_single(rows_ND.contiguous(), output_splits, input_splits, pg)
    # Typed as upstream's spmd.all_to_all(src=V, dst=V), whose list all_to_all needs equal chunks
    # on gloo (the rehearsal, the simulated hccl): the same uneven all_to_all_single, at a typing boundary.
    import spmd_types as spmd

    spmd.assert_type(rows_ND, {pg: spmd.V})
    with spmd.no_typecheck():
        exchanged_ND = all_to_all_single(rows_ND.contiguous(), output_splits, input_splits, pg)
    spmd.assert_type(exchanged_ND, spmd.get_local_type(rows_ND))
    return exchanged_ND


def dispatch_exchange(original, dispatcher, routed_input_ND, pg, output_splits, input_splits):
    return exchange(routed_input_ND, pg, output_splits, input_splits)


def combine_exchange(original, dispatcher, routed_output_RD, pg, input_splits, output_splits):
    return exchange(routed_output_RD, pg, input_splits, output_splits)


def permute(original, dispatcher, routed_input_RD, num_global_tokens_per_local_expert_E):
    ep_size = dispatcher.ep_mesh.size() if dispatcher.ep_mesh is not None else 1
    permuted_RD, permuted_indices_R, num_tokens_per_local_expert_e = moe_ops.expert_major_permutation(
        routed_input_RD, num_global_tokens_per_local_expert_E, ep_size
    )
    return routed_input_RD.shape, permuted_RD, permuted_indices_R, num_tokens_per_local_expert_e


def unpermute(original, dispatcher, routed_output_RD, input_shape, permuted_indices):
    out_RD = moe_ops.rank_major_unpermutation(routed_output_RD, permuted_indices)
    if tuple(out_RD.shape) != tuple(input_shape):
        raise ValueError(
            f"moe_dispatch: unpermuted rows {tuple(out_RD.shape)} differ from the dispatched shape "
            f"{tuple(input_shape)}; permuted_indices must come from the same dispatch"
        )
    return out_RD


def all_to_all_combine(original, dispatcher, routed_output_RD, metadata, x_TD):
    if dispatcher.ep_mesh is None:
        return LocalTokenDispatcher.combine(dispatcher, routed_output_RD, metadata, x_TD)
    import spmd_types as spmd
    from torchtitan.distributed.spmd_types import current_spmd_mesh, maybe_set_sparse_mesh
    from torchtitan.distributed.utils import get_spmd_backend

    # Upstream's combine up to the exchange; the score + scatter_add becomes the kernel.
    with maybe_set_sparse_mesh():
        if get_spmd_backend() == "spmd_types":
            pg = current_spmd_mesh().get_group("ep")
        else:
            pg = dispatcher.ep_mesh.get_group()
        routed_output_RD = dispatcher._unpermute(routed_output_RD, metadata.input_shape, metadata.permuted_indices)
        routed_output_ND = dispatcher._combine_token_exchange(
            routed_output_RD, pg, metadata.input_splits, metadata.output_splits
        )
    if _spmd_type_checking():
        routed_output_ND = spmd.reinterpret_mesh(routed_output_ND, spmd.current_mesh())
    return moe_ops.combine_by_token(
        routed_output_ND,
        metadata.token_indices_experts_sorted_N,
        metadata.topk_scores_experts_sorted_N,
        x_TD,
    )
