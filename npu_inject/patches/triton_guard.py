"""torchtitan imports without triton; only code that needs triton fails, saying what to install.

torchtitan imports ``triton`` at module level in its MinimalAsyncEP kernels
(pulled in by every model through the MoE token dispatcher) and in two
``overrides`` modules. Ascend machines often have no triton (or triton-ascend
only). When ``triton`` cannot be found, those torchtitan modules are served as
placeholders: importing them works, and touching any kernel raises an
ImportError that says what to install. When triton is importable, nothing changes.
"""

from __future__ import annotations

import importlib.util
import types

from npu_inject.patching import PatchContext
from npu_inject.module_facts import split_target

TARGETS = (
    ("torchtitan.distributed.minimal_async_ep.kernels:*",
     "when triton is not importable"),
    ("torchtitan.overrides.fused_swiglu:*",
     "when triton is not importable"),
    ("torchtitan.overrides.fused_mla:*",
     "when triton is not importable"),
)

INSTALL_HINT = (
    "install triton (pip install triton) on CUDA/CPU machines, or triton-ascend on Ascend "
    "machines, to use it"
)


def _needs_triton(module_name: str, name: str):
    """What a placeholder module gives for any name: a function that says what to install."""

    def needs_triton(*args, **kwargs):
        raise ImportError(f"{module_name}.{name} needs triton, which is not importable here; {INSTALL_HINT}")

    needs_triton.__name__ = name
    return needs_triton


def _describe(module: types.ModuleType) -> None:
    module.__doc__ = f"Placeholder (npu_inject triton_guard): {module.__name__} needs triton."


def apply(ctx: PatchContext) -> None:
    if importlib.util.find_spec("triton") is not None:
        ctx.note("triton is importable: nothing guarded")
        return
    # TARGETS lists the guarded modules as ``module:*`` targets.
    ctx.serve_modules((split_target(target)[0] for target in ctx.declared_targets), _describe,
                      missing=_needs_triton)
    ctx.fallback(
        "triton is not importable: MinimalAsyncEP kernels and the fused_swiglu/fused_mla "
        f"overrides are placeholders that raise when used ({INSTALL_HINT})"
    )
