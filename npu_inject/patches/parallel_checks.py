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


def unsupported_settings(config, target: str, tp_mc2_enabled: bool) -> list[str]:
    """One sentence per setting in ``config`` that cannot run on ``target``."""
    problems = []
    if config.compile.enable_async_tensor_parallel and not tp_mc2_enabled:
        problems.append(
            "--compile.enable_async_tensor_parallel: async TP lowers tensor-parallel matmuls to "
            "torch.ops.symm_mem fused ops, which only the tp_mc2 patch (off in TORCHTITAN_NPU_PATCHES) "
            f"runs on target {target!r}; enable tp_mc2 or remove the flag"
        )
    for backend in sorted(moe_comm_backends(config.model_spec)):
        problems.append(
            f"moe_comm_backend={backend!r} (config {config.model_spec.flavor!r} of {config.model_spec.name!r}): "
            "it needs CUDA kernels (DeepEP / CUDA symmetric memory), and torch_npu 2.14.0's MoE "
            "communication kernels have no backward (npu_moe_distribute_dispatch/combine are for inference); "
            "use the config with moe_comm_backend='standard' (all-to-all on HCCL)"
        )
    return problems


def moe_comm_backends(model_spec) -> set[str]:
    """The CUDA-only ``moe_comm_backend`` values in a model spec's config tree."""
    names = {cls: backend for backend, cls in CUDA_MOE_BACKENDS.items()}
    found: set[str] = set()
    seen: set[int] = set()

    def walk(node) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        owner = type(node).__qualname__.split(".")[0]
        if type(node).__qualname__.endswith(".Config") and owner in names:
            found.add(names[owner])
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
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
        tp_mc2_enabled = current is not None and current.enabled.get("tp_mc2", False)
        problems = unsupported_settings(config, ctx.device_kind, tp_mc2_enabled)
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
