"""torch_npu's fused kernels, forwarded to the project's reference versions.

``npu_inject.ops.reference`` holds plain-PyTorch implementations named like
torch_npu's kernels; on the simulated npu they run through the CPU fallback.
The import happens on the first kernel call, not when torch_npu is imported, so
that importing torch_npu (which the runtime does while activating) stays cheap and
the stand-in imports without npu_inject on sys.path.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

_REFERENCE_MODULE = "npu_inject.ops.reference"


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
    return function


def npu_fusion_attention(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_fusion_attention")(*args, **kwargs)


def npu_grouped_matmul(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_grouped_matmul")(*args, **kwargs)


def npu_moe_token_permute(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_moe_token_permute")(*args, **kwargs)


def npu_moe_token_unpermute(*args: Any, **kwargs: Any) -> Any:
    return _reference("npu_moe_token_unpermute")(*args, **kwargs)
