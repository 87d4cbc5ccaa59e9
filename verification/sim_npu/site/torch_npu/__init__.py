"""Simulated ``torch_npu`` for tests -- NOT Huawei's Ascend package.

Importing it registers a simulated "npu" device in PyTorch (PrivateUse1
renamed to "npu", host memory counted as device memory, aten ops through a
CPU fallback), ``torch.npu``, and an "hccl" process-group backend that runs
collectives through gloo. See verification/sim_npu/README.md.

It refuses to import unless ``TORCHTITAN_NPU_SIM=1``, so that a test
directory left on ``sys.path`` can never shadow a real torch_npu.
"""

import os

if os.environ.get("TORCHTITAN_NPU_SIM") != "1":
    raise ImportError(
        "This `torch_npu` is the simulated NPU stand-in from verification/sim_npu/site "
        "(test tooling, not Huawei's Ascend package). It imports only when the "
        "environment has TORCHTITAN_NPU_SIM=1 (got "
        f"{os.environ.get('TORCHTITAN_NPU_SIM')!r}). Set TORCHTITAN_NPU_SIM=1 to "
        "use the simulator, or remove verification/sim_npu/site from sys.path/PYTHONPATH "
        "to use a real torch_npu."
    )

__simulated__ = True
__version__ = "2.14.0"

import torch  # noqa: E402

from torch_npu import _backend  # noqa: E402

_backend.install()

npu = torch.npu  # the device module, as in the real package (torch_npu.npu)

from torch_npu import _audit, _aten_extras, _reference_ops, distributed, optim  # noqa: E402,F401


def _fused(name: str):
    """torch_npu.<name>: one NPU kernel on a real NPU, so the audit does not look inside it."""
    import functools

    function = getattr(_reference_ops, name)

    @functools.wraps(function)
    def run(*args, **kwargs):
        audit = _audit.active()
        if audit is None:
            return function(*args, **kwargs)
        return audit.call_fused(name, function, *args, **kwargs)

    return run


npu_all_gather_base_mm = _fused("npu_all_gather_base_mm")
npu_mm_reduce_scatter_base = _fused("npu_mm_reduce_scatter_base")
npu_fusion_attention = _fused("npu_fusion_attention")
npu_fusion_attention_v3 = _fused("npu_fusion_attention_v3")
npu_grouped_matmul = _fused("npu_grouped_matmul")
npu_moe_token_permute = _fused("npu_moe_token_permute")
npu_moe_token_unpermute = _fused("npu_moe_token_unpermute")
npu_rms_norm = _fused("npu_rms_norm")
npu_rotary_mul = _fused("npu_rotary_mul")
npu_swiglu = _fused("npu_swiglu")
npu_swiglu_backward = _fused("npu_swiglu_backward")  # torch_npu/utils/custom_ops.py aliases it too

__all__ = [
    "npu",
    "optim",
    "distributed",
    "npu_all_gather_base_mm",
    "npu_mm_reduce_scatter_base",
    "npu_fusion_attention",
    "npu_fusion_attention_v3",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_swiglu_backward",
]
