"""Compiles and loads the simulator's C++ extension (tools/sim_npu/csrc).

The shared library is cached under tools/sim_npu/build/<torch version>/ and is
rebuilt only when a source changes. torch.utils.cpp_extension serialises
concurrent builds with a file baton in that directory, so several torchrun
ranks importing the stand-in at once build it once and all load it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SIM_ROOT = Path(__file__).resolve().parent
SOURCES = [SIM_ROOT / "csrc" / "sim_npu.cpp"]
EXTENSION_NAME = "torch_npu_sim_C"


def build_directory() -> Path:
    import torch

    # One directory per torch build: the library links against its ABI.
    tag = torch.__version__.replace("+", "_")
    return SIM_ROOT / "build" / f"torch-{tag}"


def load_extension(verbose: bool = False) -> None:
    """Build (if needed) and load the extension into this process."""
    if shutil.which("ninja") is None and not _ninja_in_venv():
        raise RuntimeError(
            "Building the simulated NPU extension needs the `ninja` build tool, "
            "which is not on PATH. Install it with `pip install ninja` into the "
            "environment that runs the tests."
        )
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(path) for path in SOURCES],
        build_directory=str(directory),
        extra_cflags=["-O2", "-Wno-unused-parameter"],
        is_python_module=False,
        verbose=verbose,
    )


def _ninja_in_venv() -> bool:
    import sys

    candidate = Path(sys.executable).parent / "ninja"
    if candidate.exists():
        # cpp_extension looks ninja up on PATH; the venv's bin dir may not be on it.
        os.environ["PATH"] = f"{candidate.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    return False
