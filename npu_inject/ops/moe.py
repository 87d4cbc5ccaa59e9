"""torchtitan's MoE expert matmuls and token routing as torch_npu kernel calls.

Shape suffixes follow torchtitan's ``models/common/moe.py``: T tokens, K top-k,
N = T*K routed slots, D model dim, E experts (the local shard under expert
parallelism), e local experts, EP expert-parallel ranks, R rows routed to this
rank's experts. A grouped matmul multiplies R rows of width I by per-expert
(I, O) matrices, hence ``x_RI``, ``weight_EIO``, ``y_RO``.

Kernels (on ``npu_inject.ops.kernels()``: torch_npu on an NPU, the rehearsal's namespaces on the CPU):

* ``npu_grouped_matmul`` -- expert rows are consecutive, so one x and one 3-D
  weight with ``group_type=0`` (split along M), ``split_item=3`` (one output
  tensor) and ``group_list`` = torchtitan's cumulative token offsets, i.e.
  ``group_list_type=0``. Experts with no tokens are empty groups; nothing needs
  padding or 16-byte alignment.
* ``npu_moe_token_permute`` -- a stable sort of token slots by expert id; its
  ``sorted_indices`` maps slot -> permuted row.
* ``npu_moe_token_unpermute`` -- gathers rows back per slot, weights them by the
  routing scores and sums each token's top-k rows.

torchtitan's dispatch metadata keeps upstream's meaning (row -> token, gather
indices), so subclasses that override one half of a permute/unpermute pair still
pair correctly; the kernels' slot order is derived from it where needed.
"""

from __future__ import annotations

import functools

import spmd_types as spmd
import torch
from torch._prims_common import is_contiguous_or_false
from torch.utils._python_dispatch import _disable_current_modes
from torch.fx.experimental.symbolic_shapes import guard_or_false

from npu_inject.ops import kernels

# Kernel settings for torchtitan's layout (see the module docstring).
GROUP_ALONG_M = 0
GROUP_ALONG_K = 2
CUMULATIVE_GROUP_LIST = 0
GROUP_LIST_DTYPE = torch.int64  # CANN's group_list; offsets made in it need no cast per grouped matmul
SINGLE_X_SINGLE_Y = 3


# --------------------------------------------------------------------------------------
# Grouped matmul
# --------------------------------------------------------------------------------------


def _grouped_matmul_along_m(x_RI: torch.Tensor, weight_EIO: torch.Tensor, group_list_E: torch.Tensor) -> torch.Tensor:
    """y[rows of expert g] = x[rows of expert g] @ weight[g]; rows of g end at group_list[g]."""
    (y_RO,) = kernels().npu_grouped_matmul(
        [x_RI],
        [weight_EIO],
        group_list=group_list_E,
        group_list_type=CUMULATIVE_GROUP_LIST,
        group_type=GROUP_ALONG_M,
        split_item=SINGLE_X_SINGLE_Y,
    )
    return y_RO


def _grouped_matmul_along_k(x_IR: torch.Tensor, y_RO: torch.Tensor, group_list_E: torch.Tensor,
                            provider=None) -> torch.Tensor:
    """out[g] = x[:, rows of g] @ y[rows of g]: the per-expert weight gradient, shape (E, I, O)."""
    (out_EIO,) = (provider or kernels()).npu_grouped_matmul(
        [x_IR],
        [y_RO],
        group_list=group_list_E,
        group_list_type=CUMULATIVE_GROUP_LIST,
        group_type=GROUP_ALONG_K,
        split_item=SINGLE_X_SINGLE_Y,
    )
    return out_EIO


# Local for spmd_types type checking (no collectives): typed as the checker types npu_grouped_matmul itself.
@spmd.register_local_autograd_function
class _GroupedMatmulKernelBackward(torch.autograd.Function):
    """Forward and both gradients as grouped-matmul kernel calls.

    torch_npu registers no autograd formula for npu_grouped_matmul, so the
    gradients are kernel calls too: dx groups along M with the transposed
    weights, dweight groups along K (the rows) of x^T and dy.
    """

    @staticmethod
    def forward(ctx, x_RI, weight_EIO, group_list_E):
        ctx.save_for_backward(x_RI, weight_EIO, group_list_E)
        return _grouped_matmul_along_m(x_RI, weight_EIO, group_list_E)

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, weight_EIO, group_list_E = ctx.saved_tensors
        # e.g. an expanded gradient of .sum() has zero strides, a split of a fused gradient a row stride twice
        # its width. Under torch.compile R is data-dependent and .contiguous() would guard on it: unknown
        # contiguity copies.
        if not is_contiguous_or_false(grad_RO):
            grad_RO = grad_RO.clone(memory_format=torch.contiguous_format)
        grad_x_RI = grad_weight_EIO = None
        if ctx.needs_input_grad[0]:
            grad_x_RI = _grouped_matmul_along_m(grad_RO, weight_EIO.transpose(-2, -1), group_list_E)
        if ctx.needs_input_grad[1]:
            grad_weight_EIO = _grouped_matmul_along_k(x_RI.transpose(0, 1), grad_RO, group_list_E)
        return grad_x_RI, grad_weight_EIO, None


@functools.lru_cache(maxsize=None)
def _groups_along_k(provider_name: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether the kernel provider implements group_type=2 (checked once per provider, device, dtype)."""
    device = torch.device(device_type)
    # Transposed, as the backward passes it: CANN's GroupedMatmul refuses a row-major x along K (161002).
    x_IR = torch.ones(3, 2, device=device, dtype=dtype).transpose(0, 1)
    y_RO = torch.ones(3, 2, device=device, dtype=dtype)
    group_list_E = torch.tensor([1, 3], dtype=torch.int64, device=device)
    # The provider as the caller sees it (the planner's fakes under its fake tensor mode), then called
    # outside any dispatch mode: the first call may come inside selective activation checkpointing,
    # whose mode would record the probe's op and replay its output for a later grouped matmul.
    provider = kernels()
    with _disable_current_modes(), torch.no_grad():
        try:
            _grouped_matmul_along_k(x_IR, y_RO, group_list_E, provider)
        except NotImplementedError:
            return False
    return True


def kernel_backward_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when gradients can be kernel calls (the provider groups along K for this dtype).

    False means the provider computes the weight gradient only through autograd
    of its own forward (a provider whose npu_grouped_matmul raises NotImplementedError
    for group_type=2; torch_npu's documents list only -1 and 0 for Atlas A2).
    """
    return _groups_along_k_constant(kernels().__name__, device.type, dtype)


@torch.compiler.assume_constant_result  # under torch.compile: probed for real while tracing, then a constant
def _groups_along_k_constant(provider_name: str, device_type: str, dtype: torch.dtype) -> bool:
    return _groups_along_k(provider_name, device_type, dtype)


def grouped_matmul_RO(
    x_RI: torch.Tensor,
    weight_EIO: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    kernel_backward: bool,
) -> torch.Tensor:
    """``torch._grouped_mm(x_RI, weight_EIO, offs=offsets_E)`` through npu_grouped_matmul.

    ``offsets_E`` are torchtitan's cumulative row ends per expert (any integer
    dtype; the kernel takes int64, :data:`GROUP_LIST_DTYPE`: other dtypes cost a cast). The output has x's dtype. With
    ``kernel_backward`` the gradients are kernel calls as well; otherwise they
    come from autograd through the kernel call.
    """
    if x_RI.dim() != 2 or weight_EIO.dim() != 3 or offsets_E.dim() != 1:
        raise ValueError(
            f"grouped_matmul_RO: x_RI must be 2-D (rows, in), weight_EIO 3-D (experts, in, out) and "
            f"offsets_E 1-D, got {tuple(x_RI.shape)}, {tuple(weight_EIO.shape)}, {tuple(offsets_E.shape)}"
        )
    if offsets_E.shape[0] != weight_EIO.shape[0] or guard_or_false(x_RI.shape[1] != weight_EIO.shape[1]):
        raise ValueError(
            f"grouped_matmul_RO: offsets_E has {offsets_E.shape[0]} experts and x_RI width {x_RI.shape[1]}; "
            f"weight_EIO {tuple(weight_EIO.shape)} needs one offset per expert and width {weight_EIO.shape[1]}"
        )
    group_list_E = offsets_E.to(GROUP_LIST_DTYPE)
    if guard_or_false(x_RI.shape[0] == 0):  # data-dependent under torch.compile: trace the general path
        # No routed rows on this rank: skip the kernel but keep both inputs in the
        # graph, so every rank produces (zero) expert gradients for FSDP to reduce.
        return torch.matmul(x_RI, weight_EIO[0]) if weight_EIO.shape[0] else x_RI.new_zeros(0, weight_EIO.shape[2])
    needs_grad = torch.is_grad_enabled() and (x_RI.requires_grad or weight_EIO.requires_grad)
    if kernel_backward and needs_grad:
        return _GroupedMatmulKernelBackward.apply(x_RI, weight_EIO, group_list_E)
    return _grouped_matmul_along_m(x_RI, weight_EIO, group_list_E)


# --------------------------------------------------------------------------------------
# Token permutation
# --------------------------------------------------------------------------------------


def inverse_permutation(permutation_N: torch.Tensor) -> torch.Tensor:
    """inverse[permutation[i]] = i, as int64."""
    permutation_N = permutation_N.long()
    inverse_N = torch.empty_like(permutation_N)
    inverse_N[permutation_N] = torch.arange(permutation_N.numel(), device=permutation_N.device)
    return inverse_N


def permute_tokens_by_expert(
    x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's ``_local_reorder`` through npu_moe_token_permute.

    Returns ``(routed_input_ND, token_indices_experts_sorted_N,
    topk_scores_experts_sorted_N)`` with upstream's meaning: rows sorted by expert
    (stable, so slot order within an expert), each row's source token, its score.
    """
    T, K = topk_expert_ids_TK.shape
    if x_TD.shape[0] != T or topk_scores_TK.shape != topk_expert_ids_TK.shape:
        raise ValueError(
            f"permute_tokens_by_expert: x_TD {tuple(x_TD.shape)}, topk_scores_TK {tuple(topk_scores_TK.shape)} and "
            f"topk_expert_ids_TK {tuple(topk_expert_ids_TK.shape)} must agree on T and K"
        )
    if T * K == 0:
        empty_N = topk_expert_ids_TK.new_zeros(0, dtype=torch.int64)
        return x_TD[empty_N], empty_N, topk_scores_TK.reshape(-1)[empty_N]
    routed_input_ND, row_of_slot_N = kernels().npu_moe_token_permute(x_TD, topk_expert_ids_TK)
    slot_of_row_N = inverse_permutation(row_of_slot_N)
    return routed_input_ND, slot_of_row_N // K, topk_scores_TK.reshape(-1)[slot_of_row_N]


def combine_by_token(
    routed_output_ND: torch.Tensor,
    token_indices_experts_sorted_N: torch.Tensor,
    topk_scores_experts_sorted_N: torch.Tensor,
    x_TD: torch.Tensor,
) -> torch.Tensor:
    """torchtitan's score-and-scatter_add combine through npu_moe_token_unpermute.

    ``out[t] = sum over t's rows r of score[r] * routed_output[r]``. The kernel
    reads each token's K rows at slots t*K .. t*K+K-1: a stable sort of the rows
    by token gives that slot order (within a token, rows stay in expert order;
    the sum does not depend on it). Computed in the wider of the output and score
    dtypes (upstream also scores in float32); returned in x_TD's dtype.
    """
    T = x_TD.shape[0]
    N = token_indices_experts_sorted_N.numel()
    if guard_or_false(T == 0) or guard_or_false(N == 0):
        return torch.zeros_like(x_TD) + routed_output_ND.sum() * 0
    if N % T or guard_or_false(routed_output_ND.shape[0] != N) or topk_scores_experts_sorted_N.numel() != N:
        raise ValueError(
            f"combine_by_token: routed_output_ND {tuple(routed_output_ND.shape)}, "
            f"token_indices_experts_sorted_N ({N},) and topk_scores_experts_sorted_N "
            f"({topk_scores_experts_sorted_N.numel()},) need one row per (token, k) slot of the {T} tokens"
        )
    K = N // T
    row_of_slot_N = torch.argsort(token_indices_experts_sorted_N, stable=True)
    probs_TK = topk_scores_experts_sorted_N[row_of_slot_N].view(T, K)
    compute_dtype = torch.promote_types(routed_output_ND.dtype, probs_TK.dtype)
    if torch.compiler.is_compiling():
        # torch_npu 2.14.0's unpermute returns its input as its second output (the tokens kept for backward):
        # torch.compile's custom-op aliasing check warns, and fails where CI is set (torch's coming default).
        # The same weighted sum of each token's rows: IndexSelect, Mul, ReduceSum.
        rows_TKD = routed_output_ND.to(compute_dtype).index_select(0, row_of_slot_N).view(T, K, -1)
        return (rows_TKD * probs_TK.to(compute_dtype).unsqueeze(-1)).sum(1).to(x_TD.dtype)
    out_TD = kernels().npu_moe_token_unpermute(
        routed_output_ND.to(compute_dtype), row_of_slot_N.to(torch.int32), probs_TK.to(compute_dtype)
    )
    return out_TD.to(x_TD.dtype)


def expert_major_permutation(
    routed_input_RD: torch.Tensor, num_tokens_per_rank_expert_E: torch.Tensor, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's ``AllToAllTokenDispatcher._permute`` through npu_moe_token_permute.

    Rows arrive rank-major ((e0,r0), (e1,r0), ..., (e0,r1), ...); a stable sort by
    local expert id makes them expert-major ((e0,r0), (e0,r1), ...). Returns
    ``(permuted_RD, permuted_indices_R, num_tokens_per_local_expert_e)`` where, as
    upstream, ``permuted_RD[p] = routed_input_RD[permuted_indices_R[p]]``.
    """
    E = num_tokens_per_rank_expert_E.shape[0]
    if ep_size <= 0 or E % ep_size:
        raise ValueError(
            f"expert_major_permutation: ep_size={ep_size} must be positive and divide the "
            f"{E} (rank, local expert) counts"
        )
    e = E // ep_size
    R = routed_input_RD.shape[0]
    num_tokens_per_local_expert_e = num_tokens_per_rank_expert_E.view(ep_size, e).sum(0)
    # Under torch.compile R is data-dependent (all-to-all sizes): trace the general path, which
    # handles 0 rows too; eager keeps the shortcut.
    if guard_or_false(R == 0):
        return routed_input_RD, num_tokens_per_rank_expert_E.new_zeros(0, dtype=torch.int64), num_tokens_per_local_expert_e
    device = num_tokens_per_rank_expert_E.device
    local_expert_of_segment_E = torch.arange(e, device=device).repeat(ep_size)
    local_expert_of_row_R = local_expert_of_segment_E.repeat_interleave(num_tokens_per_rank_expert_E, output_size=R)
    permuted_RD, row_of_input_R = kernels().npu_moe_token_permute(routed_input_RD, local_expert_of_row_R)
    return permuted_RD, inverse_permutation(row_of_input_R), num_tokens_per_local_expert_e


def rank_major_unpermutation(routed_output_RD: torch.Tensor, permuted_indices_R: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``AllToAllTokenDispatcher._unpermute`` through npu_moe_token_unpermute.

    ``out[permuted_indices_R[p]] = routed_output_RD[p]``: the kernel without probs
    (top-k 1) gathers ``out[i] = routed_output_RD[row_of_input[i]]``.
    """
    if guard_or_false(permuted_indices_R.numel() != routed_output_RD.shape[0]):  # unknown when compiled
        raise ValueError(
            f"rank_major_unpermutation: permuted_indices_R has {permuted_indices_R.numel()} entries for "
            f"{routed_output_RD.shape[0]} rows of routed_output_RD; pass the indices _permute returned"
        )
    if guard_or_false(routed_output_RD.shape[0] == 0):
        return routed_output_RD
    row_of_input_R = inverse_permutation(permuted_indices_R)
    if torch.compiler.is_compiling():
        # torch_npu 2.14.0's npu_moe_token_unpermute without probs returns None as the second output of
        # npu::_npu_moe_token_unpermute (the tokens kept for backward), where its fake returns a tensor:
        # aot_autograd saves that output and fails at run time. The same gather, one IndexSelect.
        return routed_output_RD.index_select(0, row_of_input_R)
    return kernels().npu_moe_token_unpermute(routed_output_RD, row_of_input_R.to(torch.int32))
