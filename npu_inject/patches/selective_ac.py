"""Selective activation checkpointing saves the fused kernels' outputs and the NPU's device-to-host copies.

torchtitan's ``SelectiveAC`` saves the outputs of a fixed list of CUDA/aten
ops (SDPA, flex attention, matmuls, collectives) and recomputes everything else
in backward; it keeps device-to-host copies (MoE's all-to-all split sizes) only
when the source device string contains "cuda". On an NPU that list misses the
fused kernels, so every checkpointed block runs ``npu_fusion_attention`` twice per
step and re-reads MoE split sizes from the device. This patch:

* extends ``SelectiveAC.get_save_ops`` with torch_npu's fused attention (v1/v2/v3)
  and grouped-matmul dispatcher ops, where the installed torch_npu registers them;
* wraps the policy torchtitan hands to ``create_selective_checkpoint_contexts`` so
  that copies from the target device to the host are saved on any device type, and so
  that a linear layer counts as the matmul it is: torch_npu registers ``aten.matmul`` as
  a kernel of its own, so on an NPU every linear reaches the policy as ``aten.matmul``,
  which upstream's policy neither saves nor counts (it knows ``aten.mm`` and ``aten.linear``),
  and every linear was recomputed in backward. The policy now sees it as ``aten.mm``: every
  other linear is saved, as torchtitan intends and as on CUDA and the CPU, where
  ``matmul`` decomposes into ``mm`` (seen on the real torch_npu 2.14.0: a 3-D and a 2-D
  ``nn.Linear`` under selective checkpointing reach the policy as ``aten.matmul`` and ``aten.t``);
* where the kernel is not a dispatcher op -- the CPU rehearsal and the simulated
  NPU run ``npu_inject.ops.reference`` in Python -- routes the reference
  ``npu_fusion_attention`` (and its TND variant ``npu_fusion_attention_v3``) through one dispatcher op
  (:mod:`npu_inject.ops.sac_dispatch`) and saves that, so the rehearsal applies
  the same policy the NPU does: one fused-attention forward per layer per step.

Measured (tests/unit/patches/test_selective_ac.py, a 2-layer llama3): fused-attention forward
calls per step with selective AC, 4 upstream and 2 with the patch (one per layer), with gradients
equal to a run without checkpointing.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.distributed.activation_checkpoint:SelectiveAC.get_save_ops",
    "torchtitan.distributed.activation_checkpoint:create_selective_checkpoint_contexts",
    ("npu_inject.ops.reference:npu_fusion_attention",
     "when a run chooses selective AC and the kernels run in Python (the rehearsal, the simulated NPU)"),
    ("npu_inject.ops.reference:npu_fusion_attention_v3",
     "when a run chooses selective AC and the kernels run in Python (the rehearsal, the simulated NPU)"),
)

_TORCH_NPU_SAVED_OPS = (
    "npu_fusion_attention", "npu_fusion_attention_v2", "npu_fusion_attention_v3",
    "npu_grouped_matmul",
)
# The reference kernels routed through the dispatcher op: v1 (BSND, context parallel) and v3 (TND).
# The reference kernels selective AC routes through one dispatcher op (declared targets, by name).
_REFERENCE_KERNELS = ("npu_fusion_attention", "npu_fusion_attention_v3")


def _dispatcher_ops(namespace: str) -> list:
    """OpOverloads of the fused kernels registered in ``namespace``: torch_npu's ("npu"), or the
    rehearsal's custom ops that stand for them under torch.compile and fake tensors ("npu_inject")."""
    import torch

    found = []
    for name in _TORCH_NPU_SAVED_OPS:
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue  # not registered: no torch_npu, or the simulated one (Python kernels)
        found.extend(getattr(packet, overload) for overload in packet.overloads())
    return found


def apply(ctx: PatchContext) -> None:
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    npu_ops = _dispatcher_ops("npu")
    if npu_ops:
        ctx.note("selective AC saves torch_npu ops: " + ", ".join(sorted({str(op) for op in npu_ops})))
    reference_routed: list[bool] = []

    def get_save_ops(original, policy):
        save_ops = set(original(policy)) | set(npu_ops)
        if not npu_ops:
            # Only when selective AC is chosen: the op's backward recomputes the attention,
            # which costs a run without checkpointing one extra forward.
            # Imported here: registering the dispatcher op costs ~40 ms at start-up,
            # paid only by runs that choose selective AC.
            from npu_inject.ops import sac_dispatch

            if not reference_routed:
                reference_routed.append(True)
                for name in _REFERENCE_KERNELS:
                    ctx.replace(name, getattr(sac_dispatch, name))
                ctx.note("selective AC saves the reference npu_fusion_attention as one dispatcher op "
                         f"({sac_dispatch.FUSION_ATTENTION_OP_NAME}): the kernel runs in Python on "
                         f"target {ctx.device_kind}")
            save_ops.add(sac_dispatch.FUSION_ATTENTION_OP)
            # Compiled or under fake tensors the kernels are the rehearsal's custom ops: saved as torch_npu's.
            from npu_inject.ops import rehearsal  # noqa: F401 (registers the ops)

            save_ops.update(_dispatcher_ops(rehearsal.NAMESPACE))
        return save_ops

    def create_selective_checkpoint_contexts(original, policy_fn_or_list, *args, **kwargs):
        if not callable(policy_fn_or_list):
            return original(policy_fn_or_list, *args, **kwargs)
        upstream_policy = policy_fn_or_list

        def policy(sac_ctx, func, *op_args, **op_kwargs):
            # Upstream keeps only "cuda" -> cpu copies; the NPU's are as costly to redo
            # (a host synchronisation each, e.g. MoE all-to-all split sizes).
            if (
                ctx.device_kind == "npu"
                and func == torch.ops.aten._to_copy.default
                and "npu" in str(op_args[0].device)
                and str(op_kwargs.get("device", "")) == "cpu"
            ):
                return CheckpointPolicy.MUST_SAVE
            if func == torch.ops.aten.matmul.default:
                # torch_npu's leaf matmul of a linear: upstream's mm rule (count, save every other one,
                # honour force_recompute_mm_shapes_by_fqns on args[1], the (in, out) weight as for mm).
                func = torch.ops.aten.mm.default
            return upstream_policy(sac_ctx, func, *op_args, **op_kwargs)

        return original(policy, *args, **kwargs)

    ctx.wrap("SelectiveAC.get_save_ops", get_save_ops)
    ctx.wrap("create_selective_checkpoint_contexts",
             create_selective_checkpoint_contexts)
