"""Plain-PyTorch reference implementations of the torch_npu kernels npu_inject calls.

One module per torch_npu kernel family; this package re-exports the kernels under
torch_npu's names, so :func:`npu_inject.ops.kernels` can return it in place of
``torch_npu``. Each function carries torch_npu 2.14.0's name, parameter names,
defaults and return structure; semantics follow the wheel's ``_op_plugin_docs.py``
and ``op_plugin/meta/_meta_registrations.py``, digested in ``verification/torch_npu_docs.md``.

Forward and backward go through ordinary torch autograd. Half-precision inputs are
computed in float32 and cast back. Documented arguments and modes that npu_inject
never passes are either implemented and tested against independent math or raise
``NotImplementedError`` naming the argument: the reference never computes something
different from the kernel.
"""

from __future__ import annotations

from npu_inject.ops.reference.fusion_attention import npu_fusion_attention, npu_fusion_attention_v3
from npu_inject.ops.reference.gated_delta_rule import npu_chunk_gated_delta_rule
from npu_inject.ops.reference.grouped_matmul import npu_grouped_matmul
from npu_inject.ops.reference.mc2 import npu_all_gather_base_mm, npu_mm_reduce_scatter_base
from npu_inject.ops.reference.moe_token_permute import npu_moe_token_permute, npu_moe_token_unpermute
from npu_inject.ops.reference.rms_norm import npu_rms_norm, npu_rms_norm_backward
from npu_inject.ops.reference.rotary_mul import npu_rotary_mul, npu_rotary_mul_backward
from npu_inject.ops.reference.swiglu import npu_swiglu, npu_swiglu_backward

__all__ = [
    "npu_all_gather_base_mm",
    "npu_chunk_gated_delta_rule",
    "npu_fusion_attention",
    "npu_fusion_attention_v3",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_mm_reduce_scatter_base",
    "npu_moe_token_unpermute",
    "npu_rms_norm",
    "npu_rms_norm_backward",
    "npu_rotary_mul",
    "npu_rotary_mul_backward",
    "npu_swiglu",
    "npu_swiglu_backward",
]
