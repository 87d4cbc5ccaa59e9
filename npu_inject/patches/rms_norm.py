"""torchtitan's RMSNorm modules as one npu_rms_norm each; parameters unchanged.

torchtitan's ``RMSNorm`` (``models/common/nn_modules.py``) is ``nn.RMSNorm``,
whose forward is a chain of small ops (pow, mean, rsqrt, two muls) on an NPU. This
patch gives torchtitan's ``RMSNorm`` its own forward: one ``npu_rms_norm(x, weight,
epsilon=eps)`` (the reference kernel in the rehearsal) for every norm built from it --
the blocks' attention_norm/ffn_norm, the final norm, Qwen3's q/k norms and MLA's
q/kv norms. Subclasses with their own forward (muse_glimmer's gain-centered norm) and
norms without a weight or eps keep upstream's forward (a fallback in the report).
Parameter names and shapes are untouched.

``npu_add_rms_norm`` is not used: torchtitan's blocks compute ``h = x + attention(...)``
and then ``ffn_norm(h)`` in ``Decoder`` layers' forward, so fusing the add would mean
replacing each model's block forward rather than a module the models share.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.models.common.nn_modules:RMSNorm.forward",
)


def apply(ctx: PatchContext) -> None:
    from npu_inject.ops import kernels

    def forward(original, norm, x):
        if norm.weight is None or norm.eps is None:
            ctx.fallback("an RMSNorm without weight or eps runs upstream's forward (npu_rms_norm needs both)")
            return original(norm, x)
        # Contiguous in, as torch's own rms_norm returns it: torch_npu's meta gives ``out`` the input's
        # strides (empty_like), and torchtitan's MoE views the ffn_norm output, which a compiled
        # sequence-parallel shard (transposed (L, B, D) memory) would otherwise fail to trace.
        out, _rstd = kernels().npu_rms_norm(x.contiguous(), norm.weight.to(x.dtype), epsilon=norm.eps)
        return out

    ctx.wrap("RMSNorm.forward", forward)
