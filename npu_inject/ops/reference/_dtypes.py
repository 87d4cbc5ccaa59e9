"""The floating dtypes the reference kernels take, and the dtype they compute in."""

from __future__ import annotations

import torch

# torch_npu takes float16/bfloat16/float32; float64 is accepted (and computed in
# float64) only so that tests can run gradcheck.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (gradcheck); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
