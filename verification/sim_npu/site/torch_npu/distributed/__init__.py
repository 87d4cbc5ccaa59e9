"""torch_npu.distributed stand-in."""

from __future__ import annotations


def is_hccl_available() -> bool:
    """The simulated "hccl" backend is registered when torch_npu is imported."""
    return True


def reinit_process_group(group=None, rebuild_link: bool = True):
    """torch_npu's recovery of the job's process groups after stop_device and restart_device (rebuild_link=False:
    HcclCommResume on each communicator). The simulated device stops no tasks, so no communicator is suspended:
    nothing to resume."""
    if not isinstance(rebuild_link, bool):
        raise TypeError(f"reinit_process_group: rebuild_link must be a bool, not {type(rebuild_link).__name__}")
    return None if not rebuild_link else group


__all__ = ["is_hccl_available", "reinit_process_group"]
