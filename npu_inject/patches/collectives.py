"""Process-group settings torchtitan gets right for NCCL only: SUM reductions, HCCL variables, fake groups on npu.

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
* NPU target, flight recorder: torchtitan maps ``--comm.trace_buf_size`` /
  ``--comm.save_traces_folder`` / ``--comm.save_traces_file_prefix`` to NCCL's
  ``TORCH_FR_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT`` and
  ``TORCH_FR_DUMP_TEMP_FILE``; torch_npu's ProcessGroupHCCL reads its own names
  (present in the torch_npu 2.14.0 binaries; the set torchtitan-npu documents in
  docs/feature_guides/metrics_and_debugging.md): ``TORCH_HCCL_TRACE_BUFFER_SIZE``
  and, when it is > 0, ``TORCH_HCCL_DUMP_ON_TIMEOUT=1``,
  ``TORCH_HCCL_ENABLE_MONITORING=1`` and ``TORCH_HCCL_DEBUG_INFO_TEMP_FILE`` =
  ``<dump_folder>/<save_traces_folder>/<prefix>``. HCCL's own operation timeout is
  ``HCCL_EXEC_TIMEOUT`` (left to the user).
* NPU target, dry runs: ``--comm.mode fake_backend`` / ``local_tensor`` (upstream's
  ``COMM_MODE=... ./run_train.sh``: one process standing for ``NGPU`` ranks) create torch's
  ``fake`` process group, which torch registers for cpu, cuda, hpu and xpu only, so the first
  collective on an npu tensor failed ("No backend type associated with device type npu"). The
  fake group communicates nothing on any device; the patch lets it serve npu tensors too.
"""

from __future__ import annotations

import os

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.distributed.fsdp:disable_fsdp_gradient_division",
    ("torchtitan.distributed.utils:init_distributed", "on the NPU target"),
    ("torchtitan.distributed.utils:init_fake_mode", "on the NPU target"),
)


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


def hccl_environment(comm_config, base_folder: str) -> dict[str, str]:
    """The HCCL variables equivalent to what torchtitan's init_distributed sets for NCCL."""
    environment = {
        "HCCL_CONNECT_TIMEOUT": str(int(comm_config.init_timeout_seconds)),
        "HCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_HCCL_TRACE_BUFFER_SIZE": str(int(comm_config.trace_buf_size)),
    }
    if comm_config.trace_buf_size > 0:
        dump_dir = os.path.join(base_folder, comm_config.save_traces_folder)
        environment.update({
            "TORCH_HCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_HCCL_ENABLE_MONITORING": "1",
            "TORCH_HCCL_DEBUG_INFO_TEMP_FILE": os.path.join(dump_dir, comm_config.save_traces_file_prefix),
        })
    return environment


def _set_hccl_environment(ctx: PatchContext):
    def wrapper(original, comm_config, *args, **kwargs):
        base_folder = kwargs.get("base_folder", args[1] if len(args) > 1 else "")
        for name, value in hccl_environment(comm_config, base_folder).items():
            if name not in os.environ:
                os.environ[name] = value
                ctx.note(f"set {name}={value}")
        if comm_config.trace_buf_size > 0:
            os.makedirs(os.path.dirname(os.environ["TORCH_HCCL_DEBUG_INFO_TEMP_FILE"]) or ".", exist_ok=True)
        return original(comm_config, *args, **kwargs)

    return wrapper


def _fake_group_serves_npu(ctx: PatchContext):
    def wrapper(original, *args, **kwargs):
        import torch.distributed as dist
        from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers "fake", as torch does)

        devices = dist.Backend.backend_capability[dist.Backend.FAKE]
        if "npu" not in devices:
            devices.append("npu")
            ctx.add_cleanup(lambda: devices.remove("npu") if "npu" in devices else None)
            ctx.note("--comm.mode dry run: torch's fake process group serves npu tensors (no communication)")
        return original(*args, **kwargs)

    return wrapper


def apply(ctx: PatchContext) -> None:
    ctx.wrap("disable_fsdp_gradient_division", _force_sum_reductions)
    if ctx.device_kind == "npu":
        ctx.wrap("init_distributed", _set_hccl_environment(ctx))
        ctx.wrap("init_fake_mode", _fake_group_serves_npu(ctx))


def revert(ctx: PatchContext) -> None:
    """Environment variables already read by a live process group stay as they are."""
