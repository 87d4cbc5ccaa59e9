"""torch_npu.distributed stand-in."""

from __future__ import annotations


def is_hccl_available() -> bool:
    """The simulated "hccl" backend is registered when torch_npu is imported."""
    return True


__all__ = ["is_hccl_available"]
