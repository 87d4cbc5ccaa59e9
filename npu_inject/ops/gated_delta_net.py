"""qwen3_5's gated delta-net kernels, as flash-linear-attention (``fla``) names them, in plain PyTorch.

torchtitan 0.3.0's qwen3_5 calls fla's Triton kernels for its linear-attention layers:
a depthwise causal conv1d with SiLU that restarts at every packed document, and the
chunked gated delta rule. Neither target runs Triton, and torch_npu 2.14 has no backward
for ``npu_chunk_gated_delta_rule`` (verification/torch_npu_docs.md), so both are computed here
with ordinary torch ops and autograd gives the backward:

* :func:`causal_conv1d` -- K shifted multiply-adds, each masked where the shift would
  cross into the previous document (no Python loop over documents);
* :func:`chunk_gated_delta_rule` -- l2-normalised q/k (fla's ``use_qk_l2norm_in_kernel``)
  into :func:`npu_inject.ops.reference.gated_delta_rule.npu_chunk_gated_delta_rule`.

Layouts follow fla: ``x_BTD`` (batch, tokens, channels), ``q_BTHK``/``v_BTHV`` per head,
``g_BTH`` log decays and ``beta_BTH``; packed documents come as batch 1 with
``cu_seqlens`` offsets. Arguments qwen3_5's training never passes (initial or final
recurrent state, conv cache) raise ``NotImplementedError`` rather than being ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npu_inject.ops import planner_hooks
from npu_inject.ops.reference.gated_delta_rule import npu_chunk_gated_delta_rule

L2NORM_EPS = 1e-6  # fla's l2norm epsilon, inside the square root


def _unsupported(kernel: str, **given) -> None:
    passed = sorted(name for name, value in given.items() if value is not None and value is not False)
    if passed:
        raise NotImplementedError(
            f"npu_inject {kernel} (fla stand-in) does not implement {', '.join(passed)}: qwen3_5 training "
            "passes none of them"
        )


def _token_positions(T: int, B: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """(1 or B, T) index of each token inside its document."""
    if cu_seqlens is None:
        return torch.arange(T, device=device).unsqueeze(0)
    if B != 1:
        raise ValueError(f"npu_inject causal_conv1d: cu_seqlens needs batch size 1 (packed), got {B}")
    tokens_T = torch.arange(T, device=device, dtype=cu_seqlens.dtype)
    doc_T = torch.bucketize(tokens_T, cu_seqlens[1:], right=True)
    return (tokens_T - cu_seqlens[doc_T]).unsqueeze(0)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual=None, initial_state=None, output_final_state: bool = False,
                  activation: str | None = None, backend: str | None = None,
                  cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
                  **other) -> tuple[torch.Tensor, None]:
    """Depthwise causal conv: ``out[t, d] = sum_j weight[d, K-1-j] * x[t-j, d]`` within t's document.

    x (B, T, D), weight (D, K). ``backend`` names fla's implementation and is ignored
    (there is one here); ``cu_seqlens_cpu`` is not needed. Returns (out, None).
    """
    _unsupported("causal_conv1d", residual=residual, initial_state=initial_state,
                 output_final_state=output_final_state, **other)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"npu_inject causal_conv1d: activation {activation!r}; valid: None, 'silu', 'swish'")
    B, T, D = x.shape
    K = weight.shape[-1]
    weight_DK = weight.reshape(D, K)
    position_BT = _token_positions(T, B, cu_seqlens, x.device)
    out_BTD = x * weight_DK[:, K - 1]
    for shift in range(1, K):
        # x[t - shift] belongs to t's document only when t sits at least `shift` tokens into it.
        shifted_BTD = F.pad(x, (0, 0, shift, 0))[:, :T]
        keep_BT1 = (position_BT >= shift).unsqueeze(-1).to(x.dtype)
        out_BTD = out_BTD + shifted_BTD * keep_BT1 * weight_DK[:, K - 1 - shift]
    if bias is not None:
        out_BTD = out_BTD + bias
    if activation is not None:
        out_BTD = F.silu(out_BTD)
    return out_BTD, None


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
                           **other) -> tuple[torch.Tensor, None]:
    """Gated delta rule over q/k (B, T, H, K), v (B, T, H, V), g/beta (B, T, H); returns (o (B, T, H, V), None).

    Packed documents (``cu_seqlens``, batch 1) each start from a zero state; without
    offsets every batch row is one sequence.
    """
    _unsupported("chunk_gated_delta_rule", initial_state=initial_state,
                 output_final_state=output_final_state, **other)
    B, T, H, Dk = q.shape
    if use_qk_l2norm_in_kernel:
        q, k = _l2_normalize(q), _l2_normalize(k)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"npu_inject chunk_gated_delta_rule: cu_seqlens needs batch size 1 (packed), got {B}")
        # Document lengths size the per-document loop: read them from the host copy when given.
        offsets = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        lengths_N = torch.diff(offsets.to(torch.int64))
    else:
        lengths_N = torch.full((B,), T, dtype=torch.int64)
    if planner_hooks.gated_delta_rule_lengths is not None:  # npu-inject plan: lengths a fake tensor cannot give
        lengths_N = planner_hooks.gated_delta_rule_lengths(lengths_N, B * T)
    out_TNV, _ = npu_chunk_gated_delta_rule(
        q.reshape(B * T, H, Dk), k.reshape(B * T, H, Dk), v.reshape(B * T, H, v.shape[-1]),
        beta=beta.reshape(B * T, H), g=g.reshape(B * T, H), actual_seq_lengths=lengths_N,
        scale=Dk ** -0.5 if scale is None else scale,
    )
    return out_TNV.reshape(v.shape), None


def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None,
                                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens=None, **other) -> tuple[torch.Tensor, None]:
    """fla's token-by-token kernel computes the same function: served by the chunked one."""
    if beta is None:
        raise ValueError("npu_inject fused_recurrent_gated_delta_rule: beta is required")
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, **other)


class _Unused(torch.autograd.Function):
    """qwen3_5 only registers fla's autograd Functions with spmd_types; the stand-in never calls them."""

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError(
            "npu_inject's fla stand-in computes through plain autograd: call the kernel functions "
            "(chunk_gated_delta_rule, causal_conv1d), not fla's autograd Functions"
        )


class ChunkGatedDeltaRuleFunction(_Unused):
    pass


class FusedRecurrentFunction(_Unused):
    pass


class CausalConv1dFunction(_Unused):
    pass
