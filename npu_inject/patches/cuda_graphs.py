"""CUDA graphs are off on NPU and CPU targets, and so are their config checks (expert parallel needs no extra flag).

torchtitan enables CUDA graph capture by default and validates the config for
it (``Trainer.Config._validate_cuda_graphs``): expert parallelism with the
all-to-all token dispatcher is rejected unless ``--training.disable_cuda_graphs``
is given, although capture itself only ever runs on NVIDIA CUDA. On the NPU and
in the rehearsal this patch sets ``training.disable_cuda_graphs`` before that
check, which also gives the eager ``zero_grad(set_to_none=True)`` path and drops
upstream's "only supported on NVIDIA CUDA" warning at every start.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.trainer:Trainer.Config._validate_cuda_graphs",
)


def apply(ctx: PatchContext) -> None:
    def validate_cuda_graphs(original, config):
        if not config.training.disable_cuda_graphs:
            config.training.disable_cuda_graphs = True
            ctx.note(f"training.disable_cuda_graphs set: no CUDA graphs on target {ctx.device_kind}")
        return original(config)

    ctx.wrap("Trainer.Config._validate_cuda_graphs", validate_cuda_graphs)
