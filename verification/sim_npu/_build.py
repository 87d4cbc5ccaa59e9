"""Compiles and loads the simulator's C++ extension (verification/sim_npu/csrc).

The shared library is cached under verification/sim_npu/build/<torch build>/, one
directory per torch installation (two virtualenvs sharing this checkout would
otherwise overwrite each other's objects and rebuild forever). A stamp file
records the digest of the sources and flags the library was built from; when
it matches, the library is loaded directly without invoking the compiler
toolchain. Otherwise torch.utils.cpp_extension builds it, serialising
concurrent builds (several torchrun ranks importing at once) with a file baton
in that directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

SIM_ROOT = Path(__file__).resolve().parent
SOURCES = [SIM_ROOT / "csrc" / "sim_npu.cpp"]
EXTENSION_NAME = "torch_npu_sim_C"
EXTRA_CFLAGS = ["-O2", "-Wno-unused-parameter"]


def build_directory() -> Path:
    import torch

    installation = f"{Path(torch.__file__).resolve().parent}|{sys.version}"
    tag = hashlib.sha256(installation.encode()).hexdigest()[:10]
    version = torch.__version__.replace("+", "_")
    return SIM_ROOT / "build" / f"torch-{version}-{tag}"


def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join(EXTRA_CFLAGS).encode())
    return digest.hexdigest()


def load_extension(verbose: bool = False) -> None:
    """Build the extension if its sources changed, and load it into this process."""
    import torch

    directory = build_directory()
    library = directory / f"{EXTENSION_NAME}.so"
    stamp = directory / f"{EXTENSION_NAME}.stamp"
    digest = _source_digest()
    if library.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        torch.ops.load_library(str(library))
        return

    if shutil.which("ninja") is None and not _ninja_in_venv():
        raise RuntimeError(
            "Building the simulated NPU extension needs the `ninja` build tool, "
            "which is not on PATH. Install it with `pip install ninja` into the "
            "environment that runs the tests."
        )
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(path) for path in SOURCES],
        build_directory=str(directory),
        extra_cflags=EXTRA_CFLAGS,
        is_python_module=False,
        verbose=verbose,
    )
    # Atomic: another rank may be reading the stamp right now.
    partial = stamp.with_suffix(f".stamp.{os.getpid()}")
    partial.write_text(digest + "\n")
    partial.replace(stamp)


def _ninja_in_venv() -> bool:
    candidate = Path(sys.executable).parent / "ninja"
    if candidate.exists():
        # cpp_extension looks ninja up on PATH; the venv's bin dir may not be on it.
        os.environ["PATH"] = f"{candidate.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    return False
