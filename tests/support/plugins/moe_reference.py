"""TEST ONLY: MoE in plain PyTorch, the independent baseline for moe_dispatch's loss parity.

Test-only third-party patch: torchtitan MoE experts and dispatch in plain PyTorch.

The independent baseline for moe_dispatch's loss parity: it shares no code with
npu_inject's moe_dispatch patch, its ops glue or its reference kernels.

* grouped matmul: a Python loop over experts (``torch.split`` by the offsets,
  float32 products cast back to the input dtype, as a bf16 grouped GEMM
  accumulates in float32);
* token reorder / combine: an explicit stable ``torch.sort`` by expert id and an
  ``index_add_`` of score-weighted rows in float32;
* expert-parallel reorder: a stable sort by local expert id, undone by ``index_copy``;
* token exchange: ``torch.distributed.nn.functional.all_to_all_single`` on the
  expert-parallel group.

Joins through a user registry (moe_reference_registry.json) with this directory
on PYTHONPATH; select it with ``TORCHTITAN_NPU_PATCHES=-moe_dispatch,+moe_reference``.
"""

from __future__ import annotations

TARGETS = (
    "torchtitan.models.common.moe:GroupedExperts._grouped_mm",
    "torchtitan.models.common.token_dispatcher:LocalTokenDispatcher._local_reorder",
    "torchtitan.models.common.token_dispatcher:LocalTokenDispatcher.combine",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._dispatch_token_exchange",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._permute",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._unpermute",
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._combine_token_exchange",
)

_DISPATCHER = "torchtitan.models.common.token_dispatcher"


def loop_grouped_mm(A, B_t, offs):
    """out[rows of expert e] = A[rows of e] @ B_t[e]; rows past the last offset are 0."""
    import torch

    ends = [int(v) for v in offs.tolist()]
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    tail = A.shape[0] - ends[-1]
    pieces = torch.split(A, sizes + [tail])
    outs = [
        (piece.float() @ weight.float()).to(A.dtype)
        for piece, weight in zip(pieces[:-1], B_t.unbind(0))
    ]
    outs.append(A.new_zeros(tail, B_t.shape[-1]))
    return torch.cat(outs)


def sort_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK, top_k):
    import torch

    _, order_N = torch.sort(topk_expert_ids_TK.reshape(-1), stable=True)
    return x_TD[order_N // top_k], order_N // top_k, topk_scores_TK.reshape(-1)[order_N]


def weighted_index_add(routed_output_ND, token_indices_N, scores_N, x_TD):
    import torch

    weighted_ND = routed_output_ND.float() * scores_N.float().unsqueeze(-1)
    out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    return out_TD.index_add(0, token_indices_N, weighted_ND).to(x_TD.dtype)


def apply(ctx):
    import torch
    from torch.distributed.nn.functional import all_to_all_single

    def grouped_mm(original, experts, *, A, B_t, offs):
        return loop_grouped_mm(A, B_t, offs)

    def local_reorder(original, dispatcher, x_TD, topk_scores_TK, topk_expert_ids_TK):
        return sort_by_expert(x_TD, topk_scores_TK, topk_expert_ids_TK, dispatcher.top_k)

    def local_combine(original, dispatcher, routed_output, metadata, x_TD):
        return weighted_index_add(
            routed_output, metadata.token_indices_experts_sorted_N, metadata.topk_scores_experts_sorted_N, x_TD
        )

    def exchange(tensor, pg, output_split_sizes, input_split_sizes):
        output = tensor.new_empty((sum(output_split_sizes),) + tuple(tensor.shape[1:]))
        return all_to_all_single(output, tensor.contiguous(), output_split_sizes, input_split_sizes, group=pg)

    def dispatch_exchange(original, dispatcher, routed_input, pg, output_splits, input_splits):
        return exchange(routed_input, pg, output_splits, input_splits)

    def combine_exchange(original, dispatcher, routed_output, pg, input_splits, output_splits):
        return exchange(routed_output, pg, input_splits, output_splits)

    def permute(original, dispatcher, routed_input_RD, counts_E):
        ep_size = dispatcher.ep_mesh.size()
        local_experts = counts_E.shape[0] // ep_size
        expert_of_segment = torch.arange(local_experts, device=counts_E.device).repeat(ep_size)
        expert_of_row = torch.repeat_interleave(expert_of_segment, counts_E)
        _, order_R = torch.sort(expert_of_row, stable=True)
        return routed_input_RD.shape, routed_input_RD[order_R], order_R, counts_E.view(ep_size, -1).sum(0)

    def unpermute(original, dispatcher, routed_output_RD, input_shape, permuted_indices):
        return torch.zeros(input_shape, dtype=routed_output_RD.dtype, device=routed_output_RD.device).index_copy(
            0, permuted_indices, routed_output_RD
        )

    ctx.wrap("torchtitan.models.common.moe:GroupedExperts._grouped_mm", grouped_mm)
    ctx.wrap(f"{_DISPATCHER}:LocalTokenDispatcher._local_reorder", local_reorder)
    ctx.wrap(f"{_DISPATCHER}:LocalTokenDispatcher.combine", local_combine)
    ctx.wrap(f"{_DISPATCHER}:AllToAllTokenDispatcher._dispatch_token_exchange", dispatch_exchange)
    ctx.wrap(f"{_DISPATCHER}:AllToAllTokenDispatcher._permute", permute)
    ctx.wrap(f"{_DISPATCHER}:AllToAllTokenDispatcher._unpermute", unpermute)
    ctx.wrap(f"{_DISPATCHER}:AllToAllTokenDispatcher._combine_token_exchange", combine_exchange)
