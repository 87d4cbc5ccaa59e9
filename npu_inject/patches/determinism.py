"""--debug.deterministic sets what Ascend reads (HCCL_DETERMINISTIC, deterministic kernels), not cuDNN/cuBLAS settings.

torchtitan's ``set_determinism`` calls ``torch.use_deterministic_algorithms(True)``
(and ``fill_uninitialized_memory = False``), then sets cuDNN flags and
``CUBLAS_WORKSPACE_CONFIG``, which mean nothing on an NPU. What Ascend needs:

* Kernels: torch_npu reads torch's flag itself -- libtorch_npu passes
  ``at::Context::deterministicAlgorithms()`` to ``AclSetCompileopt(ACL_OP_DETERMINISTIC)``,
  and ``torch_npu/utils/_deterministic.py`` forwards ``fill_uninitialized_memory`` (both
  read from the torch_npu 2.14.0 wheel). So upstream's call stays; the cuDNN flags and
  ``CUBLAS_WORKSPACE_CONFIG`` are put back as they were, so the job's environment does
  not claim a cuBLAS setting.
* Collectives: ``HCCL_DETERMINISTIC=true`` makes HCCL's reductions (AllReduce,
  ReduceScatter, Reduce) deterministic (CANN environment-variable reference,
  https://www.hiascend.com/document/detail/zh/canncommercial/850/maintenref/envvar/envref_07_0099.html).
  HCCL reads it when a communicator is created, so it is set in
  ``Trainer.init_distributed``, before the process group exists -- unless the user set it
  (e.g. ``strict`` for order-preserving reductions), which is kept.

Both targets drop the cuDNN/cuBLAS settings (the rehearsal has neither library); only
the NPU target sets ``HCCL_DETERMINISTIC`` (the rehearsal's gloo reductions are
deterministic already).
"""

from __future__ import annotations

import os

from npu_inject.patching import PatchContext

TARGETS = (
    ("torchtitan.trainer:Trainer.init_distributed", "on the NPU target"),
    "torchtitan.distributed.utils:set_determinism",
)

HCCL_DETERMINISTIC = "HCCL_DETERMINISTIC"
CUDA_ONLY_VARIABLES = ("CUBLAS_WORKSPACE_CONFIG",)


def apply(ctx: PatchContext) -> None:
    def init_distributed(original, trainer, *args, **kwargs):
        if trainer.config.debug.deterministic:
            if HCCL_DETERMINISTIC in os.environ:
                ctx.note(f"{HCCL_DETERMINISTIC}={os.environ[HCCL_DETERMINISTIC]} kept (set by the user)")
            else:
                os.environ[HCCL_DETERMINISTIC] = "true"
                ctx.note(f"set {HCCL_DETERMINISTIC}=true (deterministic HCCL reductions)")
        return original(trainer, *args, **kwargs)

    def set_determinism(original, *args, **kwargs):
        import torch

        cuda_environment = {name: os.environ.get(name) for name in CUDA_ONLY_VARIABLES}
        cudnn_flags = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        result = original(*args, **kwargs)
        for name, value in cuda_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_flags
        if torch.are_deterministic_algorithms_enabled():
            ctx.note("deterministic kernels: torch.use_deterministic_algorithms(True)"
                     + (", which torch_npu passes to ACL_OP_DETERMINISTIC" if ctx.device_kind == "npu" else "")
                     + "; cuDNN/cuBLAS settings left as they were")
        return result

    if ctx.device_kind == "npu":
        ctx.wrap("Trainer.init_distributed", init_distributed)
    ctx.wrap("set_determinism", set_determinism)


def revert(ctx: PatchContext) -> None:
    """HCCL_DETERMINISTIC stays: a live process group's communicators already read it."""
