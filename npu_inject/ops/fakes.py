"""torch_npu's kernel schemas and fake (meta) implementations, for torch.compile.

Each entry mirrors one op of torch_npu 2.14.0: the argument names and defaults of
its schema (``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``) and the
output shapes of its meta registration (``torch_npu/op_plugin/meta/_meta_registrations.py``).
Returns list tensors only: torch_npu's trailing ints (fusion attention's seed,
offset, numels) are added back by the caller-facing function (``extra_outputs``).

The rehearsal (:mod:`npu_inject.ops.rehearsal`) and the simulated NPU's stand-in
register every entry as a custom op with :func:`npu_inject.ops.library.register_kernel`.
A new kernel joins by adding one :class:`KernelSpec` here: both pick it up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class KernelSpec:
    schema: str
    fake: Callable[..., Any]
    reference_module: str  # npu_inject.ops.reference.<this> implements it
    differentiable_inputs: tuple[str, ...] = ()
    differentiable_outputs: tuple[int, ...] = (0,)
    extra_outputs: tuple[Any, ...] = ()  # constants torch_npu returns after the tensors


def fusion_attention_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                          atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                          next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                          softmax_layout="", sink=None):
    """Shapes of npu_fusion_attention (BSND, BNSD, TND; the layouts npu_inject passes)."""
    if input_layout == "TND":
        tokens = query.shape[0]
        out = query.new_empty((tokens, head_num, value.shape[2]))
        statistics_shape = (tokens, head_num, 8)
    elif input_layout in ("BSND", "BNSD"):
        batch, sequence = query.shape[0], query.shape[1 if input_layout == "BSND" else 2]
        out_shape = (batch, sequence, head_num, value.shape[3]) if input_layout == "BSND" \
            else (batch, head_num, sequence, value.shape[3])
        out = query.new_empty(out_shape)
        statistics_shape = (batch, head_num, sequence, 8)
    else:
        raise NotImplementedError(
            f"npu_fusion_attention fake: input_layout={input_layout!r}; npu_inject passes BSND, BNSD or TND")
    softmax_max = query.new_empty(statistics_shape, dtype=torch.float32)
    softmax_sum = query.new_empty(statistics_shape, dtype=torch.float32)
    return out, softmax_max, softmax_sum, query.new_empty((0,))


def fusion_attention_v3_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                             softmax_layout="", sink=None):
    """Shapes of npu_fusion_attention_v3 (torch_npu/op_plugin/meta/_fake_registrations.py): v1's four
    tensors, then seed and offset as int64 tensors of shape (1,) on query's device."""
    tensors = fusion_attention_fake(query, key, value, head_num, input_layout)
    seed = query.new_empty((1,), dtype=torch.int64)
    offset = query.new_empty((1,), dtype=torch.int64)
    return (*tensors, seed, offset)


def grouped_matmul_fake(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                        antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                        activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                        group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """Shapes of npu_grouped_matmul for one x and one weight, one output (split_item 2/3): (M, N) grouped
    along M (3-D weight), (E, M, N) grouped along K (group_type=2, 2-D weight)."""
    if split_item not in (2, 3) or len(x) != 1 or len(weight) != 1:
        raise NotImplementedError(
            f"npu_grouped_matmul fake: split_item={split_item} with {len(x)} x and {len(weight)} weights; "
            "npu_inject passes one x, one weight and split_item=3")
    dtype = x[0].dtype if output_dtype is None else output_dtype
    rows, columns = x[0].shape[0], weight[0].shape[-1]
    if group_type == 2:  # grouped along K: one (rows, columns) product per group
        return [x[0].new_empty((group_list.shape[0], rows, columns), dtype=dtype)]
    return [x[0].new_empty((rows, columns), dtype=dtype)]


def moe_token_permute_fake(tokens, indices, num_out_tokens=None, padded_mode=False):
    slots = indices.numel()
    wanted = 0 if num_out_tokens is None else num_out_tokens
    rows = min(wanted, slots) if wanted > 0 else wanted + slots
    return tokens.new_empty((rows, tokens.shape[1])), tokens.new_empty((slots,), dtype=torch.int32)


def moe_token_unpermute_fake(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    top_k = 1 if probs is None else probs.shape[1]
    return permuted_tokens.new_empty((sorted_indices.shape[0] // top_k, permuted_tokens.shape[-1]))


KERNELS: dict[str, KernelSpec] = {
    "npu_grouped_matmul": KernelSpec(
        schema=(
            "(Tensor[] x, Tensor[] weight, Tensor[]? bias=None, Tensor[]? scale=None, Tensor[]? offset=None, "
            "Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, "
            "Tensor? group_list=None, Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
            "Tensor[]? activation_quant_offset=None, int split_item=0, int? group_type=None, "
            "int group_list_type=0, int act_type=0, ScalarType? output_dtype=None, int[]? tuning_config=None) "
            "-> Tensor[]"
        ),
        fake=grouped_matmul_fake,
        reference_module="grouped_matmul",
        differentiable_inputs=("x", "weight"),
    ),
    "npu_moe_token_permute": KernelSpec(
        schema="(Tensor tokens, Tensor indices, SymInt? num_out_tokens=None, bool padded_mode=False) -> (Tensor, Tensor)",
        fake=moe_token_permute_fake,
        reference_module="moe_token_permute",
        differentiable_inputs=("tokens",),
    ),
    "npu_moe_token_unpermute": KernelSpec(
        schema=(
            "(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, "
            "SymInt[]? restore_shape=None) -> Tensor"
        ),
        fake=moe_token_unpermute_fake,
        reference_module="moe_token_permute",
        differentiable_inputs=("permuted_tokens", "probs"),
    ),
    "npu_fusion_attention": KernelSpec(
        schema=(
            "(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
            "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
            "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
            "SymInt[]? prefix=None, SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, "
            "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", "
            "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor)"
        ),
        fake=fusion_attention_fake,
        reference_module="fusion_attention",
        differentiable_inputs=("query", "key", "value", "sink"),
        differentiable_outputs=(0,),
        extra_outputs=(0, 0, 0),  # seed, offset, numels: no dropout
    ),
    "npu_fusion_attention_v3": KernelSpec(
        # torch_npu 2.14.0's schema: v1's arguments with the TND lengths as (CPU) tensors, plus sink.
        schema=(
            "(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
            "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
            "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
            "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, "
            "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", "
            "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
        ),
        fake=fusion_attention_v3_fake,
        reference_module="fusion_attention",
        differentiable_inputs=("query", "key", "value", "sink"),
        differentiable_outputs=(0,),
    ),
}


def tensor_outputs(implementation: Callable[[], Callable[..., Any]], spec: KernelSpec) -> Callable[..., Any]:
    """The kernel ``implementation()`` returns (looked up per call), giving only its tensors,
    contiguous as the fake's are."""
    def run(*args, **kwargs):
        outputs = implementation()(*args, **kwargs)
        if isinstance(outputs, list):
            return [tensor.contiguous() for tensor in outputs]
        if not isinstance(outputs, tuple):
            return outputs.contiguous()
        tensors = outputs[:len(outputs) - len(spec.extra_outputs)] if spec.extra_outputs else outputs
        return tuple(tensor.contiguous() for tensor in tensors)

    return run


def with_extra_outputs(op: Callable[..., Any], spec: KernelSpec, name: str) -> Callable[..., Any]:
    """torch_npu's calling convention over the op: same arguments, the tensors plus the constants."""
    if not spec.extra_outputs:
        return op

    def kernel(*args, **kwargs):
        return (*op(*args, **kwargs), *spec.extra_outputs)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel
