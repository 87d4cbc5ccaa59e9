"""A device tensor without a device, for tests of npu_inject.ops.host_reads and its readers."""

from __future__ import annotations

import contextlib

import torch

from npu_inject import module_facts
from npu_inject.ops import host_reads
from npu_inject.patching import PatchContext


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


@contextlib.contextmanager
def applied_on_npu(patch, owner, attribute: str):
    """``patch`` (a module of npu_inject.patches) applied as on an NPU, with host_reads' cache empty; on exit
    reverted, and ``owner.attribute`` (what it wraps) is upstream's again."""
    ctx = PatchContext(patch_id=patch.__name__.rpartition(".")[2], device_kind="npu", options={},
                       declared_targets=module_facts.declared_names(patch))
    original = getattr(owner, attribute)
    patch.apply(ctx)
    host_reads.clear()
    yield
    ctx.restore()
    assert getattr(owner, attribute) is original
