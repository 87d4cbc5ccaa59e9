"""torch_npu's fused kernels, forwarded to the project's reference versions.

``npu_inject.ops.reference`` holds plain-PyTorch implementations named like
torch_npu's kernels; on the simulated npu they run through the CPU fallback.
The import happens on the first kernel call, not when torch_npu is imported, so
that importing torch_npu (which the runtime does while activating) stays cheap and
the stand-in imports without npu_inject on sys.path.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

_REFERENCE_MODULE = "npu_inject.ops.reference"

# Operators with autograd and DTensor sharding strategies, as torch_npu's are (see _block_ops), and its
# dtype check against the operator table shared with the CANN emulation (_op_support).
from torch_npu._block_ops import (  # noqa: E402,F401
    checked, npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_swiglu_backward,
)


def _reference(name: str) -> Callable[..., Any]:
    try:
        module = importlib.import_module(_REFERENCE_MODULE)
    except ImportError as error:
        raise ImportError(
            f"torch_npu.{name} (simulated) forwards to {_REFERENCE_MODULE}.{name}, "
            f"but {_REFERENCE_MODULE} could not be imported: {error}. Put the "
            "repository root on sys.path."
        ) from error
    function = getattr(module, name, None)
    if function is None:
        raise NotImplementedError(
            f"torch_npu.{name} (simulated) forwards to {_REFERENCE_MODULE}.{name}, "
            f"which {_REFERENCE_MODULE} does not define."
        )
    return checked(name, function)


def npu_fusion_attention(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_fusion_attention")(*args, **kwargs)


def npu_fusion_attention_v3(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_fusion_attention_v3")(*args, **kwargs)


def npu_grouped_matmul(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_grouped_matmul")(*args, **kwargs)


def npu_moe_token_permute(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_moe_token_permute")(*args, **kwargs)


def npu_moe_token_unpermute(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_moe_token_unpermute")(*args, **kwargs)


def _register_described_kernels() -> dict[str, Any]:
    """Kernels npu_inject.ops.fakes describes, as ``npu::`` operators with fake implementations.

    torch_npu's kernels are operators with meta registrations, which torch.compile needs to
    trace them; registering the stand-in's the same way (npu_inject.ops.library) makes a
    compiled run here fail on a kernel without one, as it would on a real NPU. A kernel
    joins by adding a KernelSpec to npu_inject/ops/fakes.py. Without npu_inject importable
    the forwarding functions above stay, and raise on first call.
    """
    if importlib.util.find_spec("npu_inject") is None:
        return {}
    from npu_inject.ops import fakes, library

    def implementation(spec: Any, name: str) -> Callable[[], Callable[..., Any]]:
        # The family module's function, looked up per call (patches may wrap the package's), refusing
        # the dtypes CANN refuses (the shared operator table, _op_support).
        module = f"{_REFERENCE_MODULE}.{spec.reference_module}"
        return lambda: checked(name, getattr(importlib.import_module(module), name))

    kernels = {}
    for name, spec in fakes.KERNELS.items():
        op = library.register_kernel(
            f"npu::{name}", spec.schema, fakes.tensor_outputs(implementation(spec, name), spec), spec.fake,
            differentiable_inputs=spec.differentiable_inputs, differentiable_outputs=spec.differentiable_outputs,
        )
        kernels[name] = fakes.with_extra_outputs(op, spec, name)
    return kernels


globals().update(_register_described_kernels())


def npu_all_gather_base_mm(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_all_gather_base_mm")(*args, **kwargs)


def npu_mm_reduce_scatter_base(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_mm_reduce_scatter_base")(*args, **kwargs)
