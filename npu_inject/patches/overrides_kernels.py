"""The --override.imports fused SwiGLU ops (Triton, CUDA-only upstream) get npu_swiglu kernels on the target's device.

``--override.imports torchtitan.overrides.fused_swiglu.fused_swiglu`` (and
``...fused_grouped_experts``) swaps torchtitan's FFN and routed experts for
modules that call the custom op ``torchtitan::silu_and_mul(gate, up, offsets=None)``
and, in its registered autograd, ``torchtitan::silu_and_mul_backward(grad_out, gate,
up, offsets=None)``. Upstream defines both with ``device_types="cuda"`` and Triton
kernels, so on any other device they have no kernel ("Could not run
'torchtitan::silu_and_mul' with arguments from the 'CPU' backend"). Their fakes and
autograd are upstream's and stay; this patch adds only the device kernels, for the
run's target (CPU in the rehearsal, PrivateUse1 on the NPU), so torch.compile still
sees one opaque op per call:

* forward: one ``npu_swiglu`` (the NPU's fused SwiGLU; the reference kernel in the
  rehearsal) through :func:`npu_inject.ops.swiglu.swiglu`;
* backward: one ``npu_swiglu_backward`` through :func:`npu_inject.ops.swiglu.swiglu_backward`.

Semantics as the Triton kernels: computed in float32, outputs contiguous in the
inputs' dtype. With ``offsets`` (the grouped-matmul offsets of the routed experts),
only rows below ``offsets[-1]`` are defined; the Triton kernels leave the rows from
``offsets[-1]`` on unwritten (``torch.empty``), these kernels write zeros there
(outputs and both gradients), masked on the device without reading offsets back.

``torchtitan.overrides.fused_mla`` needs nothing here: its ``FusedMLAAttention.forward``
runs the stock DeepSeek-V3 attention whenever ``x`` is not on CUDA, so its Triton ops
(``torchtitan::fused_mla_q_rope_``, ``fused_mla_k_rope``, ``fused_mla_kv_backward``) are
never called on these targets, and the stock path's RoPE is the rotary patch's
``npu_rotary_mul``.
"""

from __future__ import annotations

import importlib.util

from npu_inject.patching import PatchContext

TARGETS = (
    ("torchtitan.overrides.fused_swiglu:silu_and_mul_op",
     "when triton is importable (else triton_guard serves the module without ops)"),
    ("torchtitan.overrides.fused_swiglu:silu_and_mul_backward_op",
     "when triton is importable (else triton_guard serves the module without ops)"),
)


def apply(ctx: PatchContext) -> None:
    if importlib.util.find_spec("triton") is None:
        # triton_guard serves torchtitan.overrides.fused_swiglu as a placeholder: no op is defined.
        ctx.note("triton is not importable: torchtitan.overrides.fused_swiglu is a placeholder, "
                 "its ops are not defined (nothing to register)")
        return
    import torch

    from npu_inject.ops.swiglu import swiglu, swiglu_backward

    def rows_below_offsets(h_RF: torch.Tensor, offsets_E: torch.Tensor | None) -> torch.Tensor:
        """``h_RF`` with zeros in the rows from ``offsets_E[-1]`` on (the rows upstream's kernel skips)."""
        if offsets_E is None:
            return h_RF
        if offsets_E.numel() == 0:
            raise ValueError("torchtitan::silu_and_mul (npu_inject overrides_kernels): offsets must be "
                             "non-empty when provided, as upstream's kernel requires")
        rows_R = torch.arange(h_RF.shape[0], device=h_RF.device)
        return torch.where((rows_R < offsets_E[-1].to(h_RF.device))[:, None], h_RF, h_RF.new_zeros(()))

    def silu_and_mul(gate_RF, up_RF, offsets_E=None):
        return rows_below_offsets(swiglu(gate_RF, up_RF), offsets_E).contiguous()

    def silu_and_mul_backward(grad_RF, gate_RF, up_RF, offsets_E=None):
        grad_gate_RF, grad_up_RF = swiglu_backward(grad_RF, gate_RF, up_RF)
        return (rows_below_offsets(grad_gate_RF, offsets_E).contiguous(),
                rows_below_offsets(grad_up_RF, offsets_E).contiguous())

    # The ops behind TARGETS (silu_and_mul_op, silu_and_mul_backward_op): their kernels for the target's device.
    kernels = {"silu_and_mul": silu_and_mul, "silu_and_mul_backward": silu_and_mul_backward}
    undefined = [name for name in kernels if not hasattr(torch.ops.torchtitan, name)]
    if undefined:
        raise LookupError(f"torchtitan.overrides.fused_swiglu was imported but defines no torchtitan::{undefined}; "
                          f"this patch knows torchtitan's ops {sorted(kernels)}")
    key = ctx.dispatch_key
    library = torch.library.Library("torchtitan", "IMPL")
    ctx.add_cleanup(library._destroy)
    for name, kernel in kernels.items():
        library.impl(name, kernel, key)
        ctx.changed(f"{name}_op")
