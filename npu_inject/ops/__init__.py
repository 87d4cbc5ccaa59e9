"""The ops layer: each NPU kernel the patches call, and :func:`kernels`, the one place that picks whose.

The code in this folder calls kernels by torch_npu's names and signatures on the namespace
:func:`kernels` returns. Four namespaces provide them:

* ``torch_npu`` -- Ascend's kernels on an NPU target (on the simulated NPU, ``verification/sim_npu``'s
  stand-in: the reference kernels on the simulated device, behind ``npu::`` custom ops as torch_npu's);
* :mod:`npu_inject.ops.reference` -- plain PyTorch following torch_npu's documented semantics, the CPU
  rehearsal's eager kernels (what it implements and leaves NotImplemented is digested, with the doc
  entries it came from, in ``verification/torch_npu_docs.md``);
* :mod:`npu_inject.ops.rehearsal` -- those reference kernels registered as custom ops with fakes
  (:mod:`npu_inject.ops.fakes`, :mod:`npu_inject.ops.library`), so the rehearsal under torch.compile or
  spmd type checking sees one opaque op per call, as it sees torch_npu's on an NPU;
* :mod:`npu_inject.ops.planning` -- under the planner's fake tensors: what the NPU's kernels allocate and
  keep, nothing computed, each launch announced to the planner.

Which one runs, by target and by what runs the call, is :func:`kernels`'s docstring and the table
"Kernel namespaces" in docs/development.md.
"""

from __future__ import annotations

from types import ModuleType

import torch

from npu_inject import selection


def _spmd_type_checking() -> bool:
    from npu_inject.ops.spmd_typing import type_checking

    return type_checking()


def _fake_tensor_mode() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def kernels() -> ModuleType:
    """The namespace whose kernels run now; the only place that chooses it.

    ============================  ==========  =============  ==================  =====================
    target                        eager       torch.compile  spmd type checking  fake tensors (plan)
    ============================  ==========  =============  ==================  =====================
    ``npu`` (real or simulated)   torch_npu   torch_npu      torch_npu           torch_npu
    ``cpu`` (the rehearsal)       reference   rehearsal      rehearsal           planning
    ============================  ==========  =============  ==================  =====================

    On an NPU target torch_npu's kernels are dispatcher ops with fake implementations: the compiler,
    the type checker and fake tensors take them as they are. In the rehearsal the first match wins:
    torch.compile tracing, then spmd type checking (both want one op per kernel), then a FakeTensorMode
    (``npu-inject plan`` records a step), else the plain reference.

    Called for every kernel launch: the target comes from the process's selection, which the
    runtime made (and validated) at activation.
    """
    if selection.current_target() == "npu":
        import torch_npu

        return torch_npu
    # is_compiling first: dynamo cannot trace the dispatch-mode query below, and the planner
    # records a compiled job as eager.
    if torch.compiler.is_compiling() or _spmd_type_checking():
        from npu_inject.ops import rehearsal

        return rehearsal
    if _fake_tensor_mode():
        from npu_inject.ops import planning

        return planning
    from npu_inject.ops import reference

    return reference
