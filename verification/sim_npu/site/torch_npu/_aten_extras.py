"""aten overloads torch_npu 2.14.0 implements that torch has no CPU kernel for (the simulator's CPU
fallback cannot run them): each as plain PyTorch on npu tensors, with the wheel's yaml line as evidence.

* ``mm.dtype(Tensor self, Tensor mat2, ScalarType output_dtype)`` (npu_native_functions_by_codegen.yaml,
  ``supported``): the product accumulated in float32, returned in ``output_dtype`` (torchtitan's
  dist_gemm computes its row-parallel wgrad so).
"""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("aten", "IMPL")  # kept alive: its destructor removes the kernels


def _mm_dtype(self: torch.Tensor, mat2: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
    return torch.mm(self.float(), mat2.float()).to(output_dtype)


_LIBRARY.impl("mm.dtype", _mm_dtype, "PrivateUse1")
