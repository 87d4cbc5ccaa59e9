"""What the patches that recover a failed step on an NPU share (uce_repair, torchft_recover).

torch is imported by the functions only: the runtime core imports this module's names without it.
"""

from __future__ import annotations

UCE_MARK = "UCE ERROR"  # torch_npu's task queue (NPUQueue.cpp deviceErrorMap, RepoStatus::UCE_EXIT)


def reset_fsdp(model_parts) -> None:
    """FSDP as before a step that failed midway: ``FSDPModule.reset_iter_state()`` (torch 2.14's recovery call)
    on each model part's root FSDP module waits for FSDP's collectives, reshards every parameter group and
    clears the failed step's trackers."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        root = next((module for module in part.modules() if isinstance(module, FSDPModule)), None)
        if root is not None:
            root.reset_iter_state()
