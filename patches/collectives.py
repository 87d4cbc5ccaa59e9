"""collectives: process-group settings that torchtitan only gets right for NCCL.

* FSDP gradient reduction: torchtitan sets every FSDP module's gradient divide
  factor to 1.0, which makes FSDP2 reduce-scatter with ``PREMUL_SUM(1.0)``; gloo
  (the rehearsal) rejects that op and HCCL support for it differs across
  torch_npu releases. With a factor of 1.0, ``SUM`` is the same arithmetic, so on
  any non-NCCL backend the patch forces SUM reductions.
* NPU target: torchtitan writes NCCL-only variables before creating the process
  group; the HCCL equivalents are set too (only where the user has not set them):
  ``HCCL_CONNECT_TIMEOUT`` from ``--comm.init_timeout_seconds`` and
  ``HCCL_ASYNC_ERROR_HANDLING=1`` (tear down on a failed collective, as
  torchtitan asks of NCCL).
"""

from __future__ import annotations

import os

from npu_inject.patching import PatchContext


SUM_SAFE_BACKENDS_SKIPPED = ("nccl",)


def _force_sum_reductions(original, model, *args, **kwargs):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    result = original(model, *args, **kwargs)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if backend not in SUM_SAFE_BACKENDS_SKIPPED:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return result


def _set_hccl_environment(ctx: PatchContext):
    def wrapper(original, comm_config, *args, **kwargs):
        timeout = str(int(comm_config.init_timeout_seconds))
        for name, value in (("HCCL_CONNECT_TIMEOUT", timeout), ("HCCL_ASYNC_ERROR_HANDLING", "1")):
            if name not in os.environ:
                os.environ[name] = value
                ctx.note(f"set {name}={value}")
        return original(comm_config, *args, **kwargs)

    return wrapper


def apply(ctx: PatchContext) -> None:
    ctx.wrap("torchtitan.distributed.fsdp:disable_fsdp_gradient_division", _force_sum_reductions)
    if ctx.target == "npu":
        ctx.wrap("torchtitan.distributed.utils:init_distributed", _set_hccl_environment(ctx))


def revert(ctx: PatchContext) -> None:
    """Environment variables already read by a live process group stay as they are."""
