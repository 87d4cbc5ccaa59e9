"""Parallelism settings the target cannot run stop at start-up with one clear error, before any rank builds a model.

torchtitan validates its config for CUDA. Some settings pass that check and
then fail mid-run on an NPU or in the CPU rehearsal, after every rank has built
its model. This patch extends ``Trainer.Config.__post_init__`` (run on every rank
while the command line is parsed, before any mesh or model exists) with:

* ``--compile.enable_async_tensor_parallel``: Inductor's micro-pipeline TP pass
  rewrites all-gather+matmul and matmul+reduce-scatter into symmetric-memory
  fused ops (``torch.ops.symm_mem``), registered for CUDA only; torch_npu's own
  fused collectives (``npu_all_gather_base_mm``, ``npu_mm_reduce_scatter_base``)
  are not what that pass emits. Rejected on both targets, with a report note.

The context-parallel patch adds its own checks (head counts, schemes) the same way.
"""

from __future__ import annotations

from npu_inject.errors import ConfigError
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.trainer:Trainer.Config.__post_init__",
)


def unsupported_settings(config, target: str) -> list[str]:
    """One sentence per setting in ``config`` that cannot run on ``target``."""
    problems = []
    if config.compile.enable_async_tensor_parallel:
        problems.append(
            "--compile.enable_async_tensor_parallel: async TP lowers tensor-parallel matmuls to "
            "CUDA symmetric-memory kernels (torch.ops.symm_mem), which target "
            f"{target!r} does not have; remove the flag (TP then runs with ordinary collectives)"
        )
    return problems


def apply(ctx: PatchContext) -> None:
    def post_init(original, config):
        problems = unsupported_settings(config, ctx.device_kind)
        if problems:
            for problem in problems:
                ctx.note(f"rejected at start-up: {problem}")
            raise ConfigError("npu_inject (patch parallel_checks): " + "; ".join(problems))
        return original(config)

    ctx.wrap("Trainer.Config.__post_init__", post_init)
