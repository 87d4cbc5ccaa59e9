"""Simulated ``torch_npu`` for tests -- NOT Huawei's Ascend package.

Importing it registers a simulated "npu" device in PyTorch (PrivateUse1
renamed to "npu", host memory counted as device memory, aten ops through a
CPU fallback), ``torch.npu``, and an "hccl" process-group backend that runs
collectives through gloo. See tools/sim_npu/README.md.

It refuses to import unless ``TORCHTITAN_NPU_SIM=1``, so that a test
directory left on ``sys.path`` can never shadow a real torch_npu.
"""

import os

if os.environ.get("TORCHTITAN_NPU_SIM") != "1":
    raise ImportError(
        "This `torch_npu` is the simulated NPU stand-in from tools/sim_npu/site "
        "(test tooling, not Huawei's Ascend package). It imports only when the "
        "environment has TORCHTITAN_NPU_SIM=1 (got "
        f"{os.environ.get('TORCHTITAN_NPU_SIM')!r}). Set TORCHTITAN_NPU_SIM=1 to "
        "use the simulator, or remove tools/sim_npu/site from sys.path/PYTHONPATH "
        "to use a real torch_npu."
    )

__simulated__ = True
__version__ = "2.14.0"

import torch  # noqa: E402

from torch_npu import _backend  # noqa: E402

_backend.install()

npu = torch.npu  # the device module, as in the real package (torch_npu.npu)

from torch_npu import distributed, optim  # noqa: E402,F401
from torch_npu._reference_ops import (  # noqa: E402,F401
    npu_fusion_attention,
    npu_grouped_matmul,
    npu_moe_token_permute,
    npu_moe_token_unpermute,
)

__all__ = [
    "npu",
    "optim",
    "distributed",
    "npu_fusion_attention",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
]
