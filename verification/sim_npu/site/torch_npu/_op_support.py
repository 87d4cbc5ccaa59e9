"""CANN's dtype support for the stand-in's fused kernels: the CANN emulation's operator table.

One table serves both verification targets: ``verification/cann_emu/op_table.json``, read from
CANN's operator documents (Atlas A2 training products) by ``cann_emu/op_docs.py``. The emulation
compiles it into its aclnn operators; the stand-in checks each fused kernel's tensor arguments
against the row of the aclnn operator torch_npu 2.14.0 calls for that kernel, before computing it
with the reference, and refuses what CANN refuses (ACLNN_ERR_PARAM_INVALID, 161002, naming the
operator and the argument). Formats and shape rules stay the emulation's: the stand-in has no
internal formats, and the reference kernels check shapes themselves.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any, Callable

import torch

TABLE = Path(__file__).resolve().parents[3] / "cann_emu" / "op_table.json"

CANN_DTYPES = {
    torch.float32: "FLOAT", torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16", torch.float64: "DOUBLE",
    torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32", torch.int64: "INT64", torch.uint8: "UINT8",
    torch.bool: "BOOL", torch.complex64: "COMPLEX64", torch.complex128: "COMPLEX128",
}


def _attention_operator(version: str) -> Callable[[dict], str]:
    """torch_npu 2.14.0 sends the TND layout to the var-len operator, every other layout to
    FlashAttentionScore (op-plugin's npu_fusion_attention and _v3)."""
    def choose(arguments: dict) -> str:
        return f"aclnnFlashAttentionVarLenScore{version}" if arguments["input_layout"] == "TND" \
            else "aclnnFlashAttentionScore"
    return choose


_ATTENTION_ARGS = {"query": "query", "key": "key", "value": "value", "pse": "realShiftOptional",
                   "atten_mask": "attenMaskOptional"}

# kernel: (aclnn operator, or a function of the bound arguments choosing it; kernel argument -> table argument)
KERNELS: dict[str, tuple[str | Callable[[dict], str], dict[str, str]]] = {
    "npu_rms_norm": ("aclnnRmsNorm", {"self": "x", "gamma": "gamma"}),
    "npu_rms_norm_backward": ("aclnnRmsNormGrad", {"dy": "dy", "self": "x", "gamma": "gamma", "rstd": "rstd"}),
    "npu_rotary_mul": ("aclnnRotaryPositionEmbedding", {"self": "x", "r1": "cos", "r2": "sin"}),
    "npu_rotary_mul_backward": ("aclnnRotaryPositionEmbeddingGrad",
                                {"grad": "dy", "self": "xOptional", "r1": "cos", "r2": "sin"}),
    "npu_swiglu": ("aclnnSwiGlu", {"self": "x"}),
    "npu_swiglu_backward": ("aclnnSwiGluGrad", {"grad_output": "yGrad", "self": "x"}),
    "npu_grouped_matmul": ("aclnnGroupedMatmulV5", {"x": "x", "weight": "weight", "group_list": "groupListOptional"}),
    "npu_moe_token_permute": ("aclnnMoeTokenPermute", {"tokens": "tokens", "indices": "indices"}),
    "npu_moe_token_unpermute": ("aclnnMoeTokenUnpermute", {"permuted_tokens": "permutedTokens",
                                                            "sorted_indices": "sortedIndices", "probs": "probsOptional"}),
    "npu_all_gather_base_mm": ("aclnnAllGatherMatmul", {"self": "x1", "x2": "x2", "bias": "bias"}),
    "npu_mm_reduce_scatter_base": ("aclnnMatmulReduceScatter", {"self": "x1", "x2": "x2", "bias": "bias"}),
    "npu_fusion_attention": (_attention_operator(""), _ATTENTION_ARGS),
    "npu_fusion_attention_v3": (_attention_operator("V4"), _ATTENTION_ARGS),
}


@functools.cache
def table() -> dict[str, Any]:
    try:
        return json.loads(TABLE.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"the stand-in checks dtypes against {TABLE}, which is missing") from error


def check(kernel: str, arguments: dict[str, Any]) -> None:
    """Raises RuntimeError as CANN's 161002 when a tensor argument's dtype is not in the table's row."""
    operator, names = KERNELS[kernel]
    if callable(operator):
        operator = operator(arguments)
    row = table()[operator]["args"]
    for argument, table_argument in names.items():
        value = arguments.get(argument)
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(tensor, torch.Tensor):
                continue
            dtype = CANN_DTYPES.get(tensor.dtype, str(tensor.dtype))
            if dtype not in row[table_argument]:
                raise RuntimeError(
                    f"torch_npu.{kernel} (simulated): {operator} refuses {table_argument} ({argument}) of dtype "
                    f"{dtype}: ACLNN_ERR_PARAM_INVALID (161002). CANN supports {', '.join(row[table_argument])} "
                    f"on Atlas A2 training products ({table()[operator]['source']}; {TABLE.name})"
                )


@functools.lru_cache(maxsize=None)
def checked(kernel: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (the kernel's reference), after checking its arguments' dtypes (one wrapper per function)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        check(kernel, bound.arguments)
        return function(*args, **kwargs)

    return run
