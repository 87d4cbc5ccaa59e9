"""Reference ``torch_npu.npu_grouped_matmul``: one x, one weight, one output, grouped along M or K.

:mod:`npu_inject.ops.moe` calls the kernel two ways, and the reference implements both:

* the forward (and the input gradient): ``x=[x_MK]``, ``weight=[w_EKN]``, an int64
  ``group_list`` tensor, ``group_type=0`` (split along M), ``split_item=3``;
* the expert weight gradient: ``x=[x_MK]`` stored transposed (a ``(K, M)`` tensor's
  ``.t()``), ``weight=[w_KN]``, ``group_type=2`` (split along K), one ``(E, M, N)`` output.

Either ``group_list_type`` and ``split_item`` 2 or 3 (the docs give them the same output),
with the documented constraints of every argument checked. The other documented scenarios
(lists of x or 2-D weights, a List[int] group_list, bias, one output per group), grouping
along N, and the quantized path raise NotImplementedError naming what was asked: npu_inject
calls none of them.
"""

from __future__ import annotations

import torch

from npu_inject.ops.reference._dtypes import FLOAT_DTYPES, compute_dtype

# output_dtype may arrive as an at::ScalarType code (the Tensor-group_list overload's schema
# types it int?), or as a torch.dtype (the List overload and the docs).
_SCALAR_TYPE_CODES = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}
_QUANTIZED_ARGUMENTS = (
    "scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
    "activation_input", "activation_quant_scale", "activation_quant_offset",
)
_IMPLEMENTED = (
    "x=[x (M, K)], weight=[w (E, K, N)], group_type=0, or x=[x (M, K) stored transposed], weight=[w (K, N)], "
    "group_type=2; an int64 group_list tensor, split_item=2 or 3"
)


def _tensor_list(fn: str, name: str, value) -> list:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{fn}: {name} must hold at least one tensor")
    return list(value)


def _group_counts(fn: str, group_list: torch.Tensor, group_list_type: int, groups: int) -> list[int]:
    """Rows per group from cumulative end offsets (type 0) or counts (type 1)."""
    if group_list.dim() != 1 or group_list.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{fn}: group_list must be a 1-D int64 tensor, got {group_list.dtype} {tuple(group_list.shape)}"
        )
    values = [int(v) for v in group_list.tolist()]
    if any(v < 0 for v in values):
        raise ValueError(f"{fn}: group_list={values} must be non-negative")
    if group_list_type == 1:
        counts = values
    else:
        if any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(
                f"{fn}: group_list={values} with group_list_type=0 must be non-decreasing cumulative offsets"
            )
        counts = [b - a for a, b in zip([0] + values[:-1], values)]
    if len(counts) != groups:
        raise ValueError(f"{fn}: group_list has {len(counts)} groups but weight has {groups}")
    return counts


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
) -> list:
    """Reference for ``torch_npu.npu_grouped_matmul``, non-quantized, grouped along M or K.

    ``group_list`` is an int64 tensor: cumulative end offsets (``group_list_type=0``) or
    per-group counts (1). ``group_type=0``: ``x=[x_MK]``, ``weight=[w_EKN]``, returns
    ``[y_MN]`` with ``y[rows of g] = x[rows of g] @ w[g]``; if the groups cover fewer than M
    rows, the uncovered tail rows are 0 (the docs require full coverage; the NPU leaves them
    unspecified). ``group_type=2``: ``x=[x_MK]`` stored transposed, ``weight=[w_KN]``, returns
    ``[y_EMN]`` with ``y[g] = x[:, ks of g] @ w[ks of g]``. Groups may be empty. Accumulates in
    float32; output in x's dtype (``output_dtype`` may only restate it). ``tuning_config`` is a
    performance hint, ignored.
    """
    fn = "npu_grouped_matmul"
    quantized = dict(zip(_QUANTIZED_ARGUMENTS, (
        scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
        activation_input, activation_quant_scale, activation_quant_offset,
    )))
    for name, argument in quantized.items():
        if argument is not None:
            raise NotImplementedError(
                f"{fn}: {name} (quantized / activation path) is not implemented in the reference; "
                "only the non-quantized path (x, weight, group_list) is"
            )
    if act_type not in (0, None):
        raise NotImplementedError(
            f"{fn}: act_type={act_type} is only applied by the per-token quantized path; use act_type=0"
        )
    xs, ws = _tensor_list(fn, "x", x), _tensor_list(fn, "weight", weight)
    x_dtype = xs[0].dtype
    if x_dtype == torch.int8 or any(w.dtype in (torch.int8, torch.int32) for w in ws):
        raise NotImplementedError(f"{fn}: int8 / int4 inputs (quantized path) are not implemented in the reference")
    if x_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: x dtype {x_dtype} is not supported; use float16, bfloat16 or float32")
    if any(t.dtype != x_dtype for t in xs + ws):
        raise ValueError(f"{fn}: every x and weight tensor must have x's dtype {x_dtype} on the non-quantized path")
    if output_dtype is not None:
        out_dtype = _SCALAR_TYPE_CODES.get(output_dtype) if isinstance(output_dtype, int) else output_dtype
        if out_dtype != x_dtype:
            raise ValueError(
                f"{fn}: output_dtype={output_dtype} differs from x's dtype {x_dtype}; the non-quantized path "
                "outputs x's dtype (pass None)"
            )

    if split_item not in (0, 1, 2, 3):
        raise ValueError(
            f"{fn}: split_item={split_item} is not supported; use 0/1 (one output per group) or 2/3 (one output)"
        )
    if group_type not in (None, -1, 0, 1, 2):
        raise ValueError(f"{fn}: group_type={group_type} is not supported; use None, -1, 0, 1 or 2")
    if group_list_type not in (None, 0, 1):
        raise ValueError(f"{fn}: group_list_type={group_list_type} is not supported; use 0 (cumulative) or 1 (counts)")
    if group_type == 1:
        raise NotImplementedError(
            f"{fn}: group_type=1 (N-axis grouping) is not implemented in the reference; it implements {_IMPLEMENTED}"
        )
    if group_type is None and isinstance(group_list, torch.Tensor):
        raise ValueError(f"{fn}: a tensor group_list needs group_type=0 (split along M) or 2 (split along K)")
    if group_type not in (0, 2):
        raise NotImplementedError(
            f"{fn}: group_type={group_type} (lists of x, weight and y) is not implemented in the reference; "
            f"it implements {_IMPLEMENTED}"
        )
    if split_item in (0, 1):
        raise ValueError(f"{fn}: group_type={group_type} returns a single tensor; use split_item=2 or 3")
    if not isinstance(group_list, torch.Tensor):
        raise ValueError(
            f"{fn}: group_type={group_type} takes group_list as a 1-D int64 tensor, got {type(group_list).__name__}"
        )
    weight_dims = 3 if group_type == 0 else 2
    if bias is not None or len(xs) != 1 or len(ws) != 1 or ws[0].dim() != weight_dims:
        raise NotImplementedError(
            f"{fn}: bias, several x tensors and lists of weights are not implemented in the reference; "
            f"it implements {_IMPLEMENTED}"
        )
    (x_MK,), (weight,) = xs, ws
    if group_type == 0:
        return [_along_m(fn, x_MK, weight, group_list, group_list_type)]
    return [_along_k(fn, x_MK, weight, group_list, group_list_type)]


def _along_m(fn: str, x_MK: torch.Tensor, w_EKN: torch.Tensor, group_list: torch.Tensor, group_list_type: int):
    """y[rows of g] = x[rows of g] @ w[g]; rows past the last group are 0."""
    if x_MK.dim() != 2 or x_MK.shape[1] != w_EKN.shape[1]:
        raise ValueError(
            f"{fn}: x must be 2-D (M, K) with K = weight's dim 1, got x {tuple(x_MK.shape)} and weight "
            f"{tuple(w_EKN.shape)}"
        )
    counts = _group_counts(fn, group_list, group_list_type, w_EKN.shape[0])
    rows = x_MK.shape[0]
    if sum(counts) > rows:
        raise ValueError(f"{fn}: group_list covers {sum(counts)} rows but x has only {rows}")
    cdt = compute_dtype(x_MK.dtype)
    # One cast, split and unbind for all groups: autograd then stacks the weight gradient once,
    # where indexing w[g] per group zero-filled a whole (E, K, N) gradient per group (most of a
    # qwen3 MoE step in the rehearsal).
    tail = rows - sum(counts)
    x_groups = x_MK.to(cdt).split([*counts, tail])
    pieces = [torch.matmul(x_g, w_KN) for x_g, w_KN in zip(x_groups, w_EKN.to(cdt).unbind(0))]
    if tail:
        pieces.append(x_MK.new_zeros(tail, w_EKN.shape[2], dtype=cdt))
    return torch.cat(pieces, dim=0).to(x_MK.dtype)


def _is_transposed(tensor: torch.Tensor) -> bool:
    """Stored as the transpose of a row-major matrix, judged by strides as CANN does (size-1 dims too)."""
    return tensor.dim() == 2 and tensor.stride(0) == 1 and tensor.stride(1) == tensor.shape[0]


def _along_k(fn: str, x_MK: torch.Tensor, w_KN: torch.Tensor, group_list: torch.Tensor, group_list_type: int):
    """y[g] = x[:, ks of g] @ w[ks of g], shape (E, M, N); an empty group's y[g] is 0.

    CANN's layout rules (aclnnGroupedMatmulV5, as verification/cann_emu emulates them): a
    single x must be stored transposed (161002 otherwise), the weight must not be.
    """
    if x_MK.dim() != 2 or x_MK.shape[1] != w_KN.shape[0]:
        raise ValueError(
            f"{fn}: group_type=2 takes x 2-D (M, K) and weight 2-D (K, N) with the same K, got x "
            f"{tuple(x_MK.shape)} and weight {tuple(w_KN.shape)}"
        )
    if not _is_transposed(x_MK):
        raise ValueError(
            f"{fn}: group_type=2 with a single x needs x stored transposed (pass a (K, M) tensor's .t()), "
            f"got strides {x_MK.stride()} for shape {tuple(x_MK.shape)}"
        )
    if _is_transposed(w_KN) and w_KN.numel() != 1:
        raise ValueError(f"{fn}: group_type=2: x and weight can not be transposed at the same time")
    groups = group_list.shape[0] if group_list.dim() == 1 else 0
    counts = _group_counts(fn, group_list, group_list_type, groups)
    if sum(counts) > x_MK.shape[1]:
        raise ValueError(f"{fn}: group_list covers {sum(counts)} of K but x has only {x_MK.shape[1]} columns")
    cdt = compute_dtype(x_MK.dtype)
    # One group at a time into the output: memory is the output plus one group's slices, never
    # a per-group copy of the whole weight gradient.
    y_EMN = x_MK.new_zeros(len(counts), x_MK.shape[0], w_KN.shape[1], dtype=cdt)
    start = 0
    for group, count in enumerate(counts):
        if count:
            y_EMN[group].copy_(torch.matmul(x_MK[:, start:start + count].to(cdt), w_KN[start:start + count].to(cdt)))
        start += count
    return y_EMN.to(x_MK.dtype)
