"""torchtitan's device type, device module and local device come from the target: npu + torch.npu (hccl), or cpu (gloo).

torchtitan computes ``device_type, device_module`` once in
``torchtitan.tools.utils`` (``"cuda"`` on any machine without a visible
accelerator) and many modules copy both at import. This patch runs right after
``torchtitan.tools.utils`` executes -- before any importer copies them -- and sets:

* NPU target: ``"npu"`` and ``torch.npu`` (torch_npu was imported by the runtime
  before any torchtitan submodule). The process group then resolves to ``hccl``
  through torch's device -> backend map, which torch_npu fills.
* CPU rehearsal: ``"cpu"`` and a host device module whose memory figures are the
  process's resident memory, labelled as such (torch has no CPU allocator stats).
  The process group resolves to ``gloo``.
"""

from __future__ import annotations

import os
import resource
import sys
import types

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.tools.utils:device_type",
    "torchtitan.tools.utils:device_module",
    ("torchtitan.tools.utils:get_local_device",
     "in the CPU rehearsal"),
)


HOST_DEVICE_NAME = "CPU rehearsal (host memory: process RSS)"


def _read_status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` figure from /proc/self/status, in KiB (Linux)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {field} line")


class HostDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the memory API torchtitan's DeviceMemoryMonitor calls.

    Figures are the process's resident set (current and high-water mark), which is
    what "device memory" is when host and device are the same thing. They are
    reported under CUDA-style keys so torchtitan's monitor reads them unchanged;
    ``get_device_name`` says what they really measure.
    """

    def __init__(self, cpu_module: types.ModuleType) -> None:
        super().__init__("npu_inject.host_device")
        self._cpu = cpu_module

    def __getattr__(self, name: str):
        return getattr(self._cpu, name)

    def set_device(self, device) -> None:
        """One host device: nothing to select."""

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device=None) -> str:
        return HOST_DEVICE_NAME

    def get_device_properties(self, device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name=HOST_DEVICE_NAME, total_memory=total)

    def memory_stats(self, device=None) -> dict[str, int]:
        current = _read_status_kib("VmRSS") * 1024
        peak = _read_status_kib("VmHWM") * 1024
        return {
            "active_bytes.all.current": current,
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device=None) -> None:
        # Writing 5 to clear_refs resets this process's VmHWM (Linux >= 4.0).
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")

    def empty_cache(self) -> None:
        """The host allocator keeps no cache to release."""

    def max_memory_allocated(self, device=None) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _npu_module():
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or "torch_npu" not in sys.modules:
        raise RuntimeError("torch.npu is missing: torch_npu was not imported before torchtitan")
    if not npu.is_available():
        raise RuntimeError(
            "torch_npu imported but torch.npu.is_available() is False: no NPU visible "
            "(check ASCEND_RT_VISIBLE_DEVICES and the driver), or use TORCHTITAN_NPU=cpu"
        )
    return npu


def apply(ctx: PatchContext) -> None:
    import torch

    if ctx.device_kind == "npu":
        device_type, device_module = "npu", _npu_module()
        ctx.note(f"device npu x{device_module.device_count()}: {device_module.get_device_name(0)}")
    else:
        device_type, device_module = "cpu", HostDeviceModule(torch.cpu)
        ctx.note("device cpu (rehearsal); memory figures are process RSS")
    ctx.replace("device_type", device_type)
    ctx.replace("device_module", device_module)
    if ctx.device_kind == "cpu":
        # torch.device("cpu", 0) != torch.device("cpu") in device checks: use the plain host device.
        ctx.replace("get_local_device", lambda: torch.device("cpu"))
