"""Registers the simulated npu with PyTorch (once per process)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

_SIM_ROOT = Path(__file__).resolve().parents[2]  # verification/sim_npu
_installed = False

DEFAULT_DEVICE_COUNT = 8
DEFAULT_MEMORY_GB = 64.0


def _load_build_module():
    spec = importlib.util.spec_from_file_location(
        "_torch_npu_sim_build", _SIM_ROOT / "_build.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"Cannot load the simulator build helper {_SIM_ROOT / '_build.py'}.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of devices, got {raw!r}.") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of GiB, got {raw!r}.") from None


def install() -> None:
    global _installed
    if _installed:
        return
    current_name = torch._C._get_privateuse1_backend_name()
    if current_name not in ("privateuseone", "npu"):
        raise RuntimeError(
            f"Cannot register the simulated npu: PyTorch's PrivateUse1 backend is "
            f"already named {current_name!r} in this process."
        )
    if current_name == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")

    _load_build_module().load_extension()

    device_count = _env_int("TORCHTITAN_NPU_SIM_DEVICES", DEFAULT_DEVICE_COUNT)
    memory_gb = _env_float("TORCHTITAN_NPU_SIM_MEMORY_GB", DEFAULT_MEMORY_GB)
    torch.ops.npu_sim.configure(device_count, int(memory_gb * (1 << 30)))

    from torch_npu import npu as device_module

    torch._register_device_module("npu", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)

    from torch_npu import _dtensor_rng, _hccl

    _hccl.register()
    _dtensor_rng.install()
    _installed = True

    from torch_npu import _audit

    _audit.install_from_env()  # TORCHTITAN_NPU_SIM_AUDIT=1
