"""A device tensor without a device, for tests of npu_inject.ops.host_reads and its readers."""

from __future__ import annotations

import torch

from npu_inject.ops import host_reads


class DeviceTensor(torch.Tensor):
    """A CPU tensor that claims a device (host_reads treats it as a device tensor and copies it)."""

    @property
    def device(self):
        return torch.device("privateuseone", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def count_copies(monkeypatch) -> list:
    """The device-to-host copies host_reads makes from now on, one entry each."""
    made = []
    monkeypatch.setattr(host_reads, "_to_host", lambda tensor: made.append(1) or torch.Tensor(tensor).clone())
    return made
