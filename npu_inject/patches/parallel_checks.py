"""Parallelism settings the target cannot run stop at start-up with one clear error, before any rank builds a model.

torchtitan validates its config for CUDA. Some settings pass that check and
then fail mid-run on an NPU or in the CPU rehearsal, after every rank has built
its model; one fails in torchtitan's own check with a CUDA-only message. This
patch extends ``Trainer.Config.__post_init__`` (run on every rank while the
command line is parsed, before any mesh or model exists) and, for the setting
torchtitan rejects first, ``ParallelismConfig.__post_init__``, with:

* ``--compile.enable_async_tensor_parallel`` when the ``tp_mc2`` patch is off:
  inductor's micro-pipeline TP pass emits ``torch.ops.symm_mem`` fused ops, which
  only ``tp_mc2`` gives kernels here (Ascend's MC2 collective+GEMM kernels).
* ``moe_comm_backend`` ``deepep``, ``hybridep`` and ``minimal_async_ep`` (a model
  config's token dispatcher): DeepEP's and torch's CUDA symmetric-memory kernels.
  torch_npu 2.14.0's MoE communication kernels (``npu_moe_distribute_dispatch`` /
  ``_combine`` and ``_v2``) are documented for inference only and have no backward;
  ``npu_alltoallv_gmm`` / ``npu_gmm_alltoallv`` run on Atlas A3 with 8 to 64 EP ranks,
  also without backward. The ``standard`` backend (all-to-all on HCCL, with the
  ``moe_dispatch`` patch's grouped-matmul and permute kernels) trains.
* ``--parallelism.enable_fsdp_symm_mem``: FSDP's collectives in CUDA symmetric
  memory; torch_npu 2.14.0 has no symmetric-memory backend (torch's
  ``get_backend('npu')`` is None), and FSDP runs on HCCL's ordinary collectives.
* on the NPU, a model with FlexAttention or VarlenAttention while the ``attention``
  patch is off (or ``device``, which it requires): upstream's flex attention is
  ``torch.compile(flex_attention)``, which torch_npu 2.14.0's inductor fails to lower
  (its ``make_reduction`` lacks torch 2.14's ``strict_sum``; measured on the real wheel),
  and varlen attention calls CUDA's flash-attention kernel.

The context-parallel patch adds its own checks (head counts, schemes) the same way.
"""

from __future__ import annotations

import dataclasses

from npu_inject.errors import ConfigError
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.trainer:Trainer.Config.__post_init__",
    "torchtitan.config.configs:ParallelismConfig.__post_init__",
)

# torchtitan's moe_comm_backend -> the token dispatcher config class it selects (config_utils.py).
CUDA_MOE_BACKENDS = {
    "deepep": "DeepEPTokenDispatcher",
    "hybridep": "HybridEPTokenDispatcher",
    "minimal_async_ep": "MinimalAsyncEPTokenDispatcher",
}


# torchtitan's attention configs that only the attention patch runs on an NPU -> what upstream would run instead.
UPSTREAM_ATTENTION = {
    "FlexAttention": "torch.compile(flex_attention), which torch_npu 2.14.0's inductor cannot lower "
                     "(make_reduction() has no strict_sum)",
    "VarlenAttention": "torch.nn.attention.varlen_attn, CUDA's flash-attention kernel",
}


def unsupported_settings(config, target: str, enabled) -> list[str]:
    """One sentence per setting in ``config`` that cannot run on ``target`` with the patches ``enabled`` (id -> bool)."""
    problems = []
    tp_mc2_enabled = enabled.get("tp_mc2", False)
    if target == "npu" and not enabled.get("attention", False):
        for owner in sorted(config_owners(config.model_spec) & UPSTREAM_ATTENTION.keys()):
            problems.append(
                f"{owner} (config {config.model_spec.flavor!r} of {config.model_spec.name!r}) with patch attention "
                f"off (TORCHTITAN_NPU_PATCHES, or device, which it requires): upstream would run "
                f"{UPSTREAM_ATTENTION[owner]}; enable attention (on by default), which runs it on npu_fusion_attention"
            )
    if config.compile.enable_async_tensor_parallel and not tp_mc2_enabled:
        problems.append(
            "--compile.enable_async_tensor_parallel: async TP lowers tensor-parallel matmuls to "
            "torch.ops.symm_mem fused ops, which only the tp_mc2 patch (off in TORCHTITAN_NPU_PATCHES) "
            f"runs on target {target!r}; enable tp_mc2 or remove the flag"
        )
    names = {cls: backend for backend, cls in CUDA_MOE_BACKENDS.items()}
    for backend in sorted(names[owner] for owner in config_owners(config.model_spec) & names.keys()):
        problems.append(
            f"moe_comm_backend={backend!r} (config {config.model_spec.flavor!r} of {config.model_spec.name!r}): "
            "it needs CUDA kernels (DeepEP / CUDA symmetric memory), and torch_npu 2.14.0's MoE "
            "communication kernels have no backward (npu_moe_distribute_dispatch/combine are for inference); "
            "use the config with moe_comm_backend='standard' (all-to-all on HCCL)"
        )
    return problems


def config_owners(model_spec) -> set[str]:
    """The classes whose nested ``Config`` appears in a model spec's config tree (``FlexAttention``, ...)."""
    found: set[str] = set()
    seen: set[int] = set()

    def walk(node) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if type(node).__qualname__.endswith(".Config"):
            found.add(type(node).__qualname__.split(".")[0])
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                walk(getattr(node, field.name))
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)

    walk(getattr(model_spec, "model", None))
    return found


def apply(ctx: PatchContext) -> None:
    from npu_inject import selection

    def reject(problems: list[str]) -> None:
        for problem in problems:
            ctx.note(f"rejected at start-up: {problem}")
        raise ConfigError("npu_inject (patch parallel_checks): " + "; ".join(problems))

    def post_init(original, config):
        current = selection.current()
        problems = unsupported_settings(config, ctx.device_kind, current.enabled if current is not None else {})
        if problems:
            reject(problems)
        return original(config)

    def parallelism_post_init(original, parallelism):
        if parallelism.enable_fsdp_symm_mem:  # before torchtitan's own check, whose message is for CUDA
            reject([
                "--parallelism.enable_fsdp_symm_mem: FSDP in CUDA symmetric memory; torch_npu 2.14.0 has no "
                f"symmetric-memory backend, so target {ctx.device_kind!r} cannot run it; remove the flag "
                "(FSDP then runs on HCCL's all-gather and reduce-scatter)"
            ])
        return original(parallelism)

    ctx.wrap("Trainer.Config.__post_init__", post_init)
    ctx.wrap("ParallelismConfig.__post_init__", parallelism_post_init)
