"""qwen3_5's gated delta-net trains on both targets: an fla stand-in serves it in chunked PyTorch, through autograd.

torchtitan's ``torchtitan.models.qwen3_5.model`` imports flash-linear-attention
(``fla``) at module level: the chunked and fused-recurrent gated delta rule, fla's
varlen causal conv1d, and their autograd Functions (only registered with spmd_types).
Those are Triton/CUDA kernels, which neither the NPU nor the CPU rehearsal runs, and
torch_npu 2.14's ``npu_chunk_gated_delta_rule`` has no backward. This patch serves an
``fla`` stand-in package, built from :mod:`npu_inject.ops.gated_delta_net`, ahead of any
installed fla: the gated delta rule is the chunked PyTorch reference and the conv is
PyTorch, both differentiated by autograd. It is installed when ``torchtitan`` is
imported, before any model module can import fla. The fallback is reported once a
model imports the stand-in (only qwen3_5 does). model_guard lets ``--module qwen3_5``
start only while this stand-in serves ``fla``.
"""

from __future__ import annotations

import sys
import types

from npu_inject.patching import PatchContext

TARGETS = (
    "fla:*",
)

# module -> names it provides (from npu_inject.ops.gated_delta_net); packages have submodules.
STANDIN = {
    "fla": (),
    "fla.modules": (),
    "fla.modules.conv": (),
    "fla.modules.conv.triton": (),
    "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
    "fla.modules.conv.causal_conv1d": ("causal_conv1d",),
    "fla.ops": (),
    "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "fla.ops.gated_delta_rule.chunk": ("chunk_gated_delta_rule", "ChunkGatedDeltaRuleFunction"),
    "fla.ops.gated_delta_rule.fused_recurrent": ("fused_recurrent_gated_delta_rule", "FusedRecurrentFunction"),
}
PACKAGES = {name.rpartition(".")[0] for name in STANDIN} - {""}
ORIGIN = __name__  # spec.origin of every stand-in module: model_guard checks it
FALLBACK = ("gated delta rule: chunked PyTorch reference (torch_npu has no chunked backward); "
            "causal conv1d: PyTorch shifted multiply-adds; both through autograd, in place of fla's Triton kernels")


def _missing(module_name: str, name: str):
    raise AttributeError(
        f"{module_name}.{name}: npu_inject's fla stand-in (patch gated_delta_net) provides only "
        f"{', '.join(STANDIN[module_name]) or 'its submodules'}; qwen3_5 needs no more"
    )


def apply(ctx: PatchContext) -> None:
    served = [name for name in STANDIN if name in sys.modules]
    if served:
        raise RuntimeError(
            f"patch gated_delta_net: {', '.join(served)} already imported before torchtitan; the fla "
            "stand-in must be installed first (import npu_inject's runtime before fla)"
        )

    def fill(module: types.ModuleType) -> None:
        from npu_inject.ops import gated_delta_net

        module.__doc__ = f"npu_inject stand-in for {module.__name__} (patch gated_delta_net)"
        for name in STANDIN[module.__name__]:
            setattr(module, name, getattr(gated_delta_net, name))
        if STANDIN[module.__name__]:
            ctx.fallback(FALLBACK)

    ctx.serve_modules(STANDIN, fill, missing=_missing, packages=PACKAGES, origin=ORIGIN)
    ctx.note("fla is served by npu_inject.ops.gated_delta_net (chunked PyTorch gated delta rule)")
