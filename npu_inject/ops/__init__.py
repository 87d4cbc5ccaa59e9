"""The ops layer: each NPU kernel the patches call, behind one function.

``kernels()`` returns a namespace with torch_npu's op names and signatures:
torch_npu itself when the target is a (real or simulated) NPU, and
:mod:`npu_inject.ops.reference` -- plain PyTorch following torch_npu's documented
semantics -- in the CPU rehearsal. What the reference implements (and leaves
NotImplemented) is digested, with the doc entries it came from, in
``verification/torch_npu_docs.md``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from npu_inject import selection


@functools.lru_cache(maxsize=None)
def _kernels_for(target: str | None) -> ModuleType:
    if target == "npu":
        import torch_npu

        return torch_npu
    from npu_inject.ops import reference

    return reference


def _spmd_type_checking() -> bool:
    from npu_inject.ops.spmd_typing import type_checking

    return type_checking()


def _fake_tensor_mode() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def kernels() -> ModuleType:
    """torch_npu on an NPU target, the reference implementations otherwise.

    Called for every kernel launch: the target comes from the process's selection, which the
    runtime made (and validated) at activation.
    """
    target = selection.current_target()
    if target == "npu":
        return _kernels_for(target)
    # is_compiling first: dynamo cannot trace the dispatch-mode query below, and the planner
    # records a compiled job as eager.
    if torch.compiler.is_compiling() or _spmd_type_checking():
        # Under torch.compile the reference kernels are custom ops with fakes, as torch_npu's are; so
        # under spmd_types type checking, which then types each kernel as one op, as it does torch_npu's.
        from npu_inject.ops import rehearsal

        return rehearsal
    if _fake_tensor_mode():
        # npu-inject plan: what the NPU's kernels allocate and keep, nothing computed.
        from npu_inject.ops import planning

        return planning
    return _kernels_for(target)
