"""triton_guard: torchtitan imports without ``triton``; only code that needs it fails.

torchtitan 0.3.0 imports ``triton`` at module level in its MinimalAsyncEP kernels
(pulled in by every model through the MoE token dispatcher) and in two
``overrides`` modules. Ascend machines often have no triton (or triton-ascend
only). When ``triton`` cannot be found, those torchtitan modules are served as
placeholders: importing them works, and touching any kernel raises an
ImportError that says what to install. When triton is importable, nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from npu_inject.patching import PatchContext
from npu_inject.registry import split_target

INSTALL_HINT = (
    "install triton (pip install triton) on CUDA/CPU machines, or triton-ascend on Ascend "
    "machines, to use it"
)


class _NeedsTriton(types.ModuleType):
    """Stands in for a torchtitan module whose import needs triton."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        module_name = self.__name__

        def needs_triton(*args, **kwargs):
            raise ImportError(
                f"{module_name}.{name} needs triton, which is not importable here; {INSTALL_HINT}"
            )

        needs_triton.__name__ = name
        return needs_triton


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _NeedsTriton(spec.name)

    def exec_module(self, module):
        module.__doc__ = f"Placeholder (npu_inject triton_guard): {module.__name__} needs triton."


class TritonGuardFinder(importlib.abc.MetaPathFinder):
    """Serves placeholders for the modules the registry entry lists as ``module:*`` targets."""

    def __init__(self, guarded_modules: tuple[str, ...]) -> None:
        self.guarded_modules = guarded_modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.guarded_modules:
            return None
        return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader())


def apply(ctx: PatchContext) -> None:
    if importlib.util.find_spec("triton") is not None:
        ctx.note("triton is importable: nothing guarded")
        return
    finder = TritonGuardFinder(tuple(split_target(target)[0] for target in ctx.declared_targets))
    sys.meta_path.insert(0, finder)
    ctx.add_cleanup(lambda: sys.meta_path.remove(finder))
    ctx.fallback(
        "triton is not importable: MinimalAsyncEP kernels and the fused_swiglu/fused_mla "
        f"overrides are placeholders that raise when used ({INSTALL_HINT})"
    )
