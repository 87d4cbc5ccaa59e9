"""The CPU rehearsal's kernels under torch.compile and spmd type checking: the reference kernels as custom ops.

What :func:`npu_inject.ops.kernels` returns in the rehearsal while dynamo traces or spmd_types
type checks (eager runs call :mod:`npu_inject.ops.reference` directly). Every
kernel in :data:`npu_inject.ops.fakes.KERNELS` is the reference implementation
registered as ``torch.ops.npu_inject.<name>`` with its fake, so torch.compile
treats it as one opaque op, as it treats torch_npu's on an NPU: no graph break
for the host reads inside (TND lengths), and the compiled graph computes what the
eager run computes. Kernels not (yet) listed there are the plain reference
functions, which dynamo traces into.
"""

from __future__ import annotations

import importlib
from typing import Any

from npu_inject.ops import reference
from npu_inject.ops.fakes import KERNELS, tensor_outputs, with_extra_outputs
from npu_inject.ops.library import register_kernel

NAMESPACE = "npu_inject"

_registered: dict[str, Any] = {}
for _name, _spec in KERNELS.items():
    _op = register_kernel(
        f"{NAMESPACE}::{_name}",
        _spec.schema,
        # The family module's plain function, looked up per call (patches may wrap the package's).
        tensor_outputs(lambda _module=f"{reference.__name__}.{_spec.reference_module}", _kernel=_name:
                       getattr(importlib.import_module(_module), _kernel), _spec),
        _spec.fake,
        differentiable_inputs=_spec.differentiable_inputs,
        differentiable_outputs=_spec.differentiable_outputs,
    )
    _registered[_name] = with_extra_outputs(_op, _spec, _name)
globals().update(_registered)


def __getattr__(name: str) -> Any:
    # Reference kernels without a KernelSpec: the plain functions.
    return getattr(reference, name)
