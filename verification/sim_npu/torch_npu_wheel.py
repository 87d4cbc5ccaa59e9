"""The real torch_npu wheel, fetched once and read as a zip (never installed, never imported).

Importing torch_npu needs Ascend's CANN libraries; its wheel is still the truth
about what the package offers. ``wheel()`` downloads it with ``pip download
--no-deps`` into ``$NPU_INJECT_WHEEL_CACHE`` (default ``~/.cache/npu_inject/wheels``)
the first time and opens it; ``op_names_with_npu_kernel()`` reads the aten ops torch_npu
implements for the NPU from its two YAML files.

Used by tests/contract/test_torch_npu_contract.py and by the simulated NPU's audit
(site/torch_npu/_audit.py loads this file by path: the repository root need not
be on sys.path there).
"""

from __future__ import annotations

import ast

import glob
import os
import platform
import re
import subprocess
import sys
import zipfile

TORCH_NPU_VERSION = "2.14.0"
CACHE_VAR = "NPU_INJECT_WHEEL_CACHE"
OP_LIST_FILES = (
    "torch_npu/csrc/aten/npu_native_functions.yaml",
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
)
# Sections of those files that list ops with an NPU kernel (the others are settings).
OP_SECTIONS = ("supported", "symint", "custom", "autograd", "quant")


def cache_dir() -> str:
    return os.environ.get(CACHE_VAR) or os.path.expanduser("~/.cache/npu_inject/wheels")


def wheel() -> zipfile.ZipFile:
    """The torch_npu wheel for this Python and machine, downloaded on first use."""
    cache = cache_dir()
    pattern = os.path.join(cache, f"torch_npu-{TORCH_NPU_VERSION}-*.whl")
    if not glob.glob(pattern):
        python = f"{sys.version_info.major}{sys.version_info.minor}"
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", python, "--implementation", "cp", "--abi", f"cp{python}",
             "--platform", f"manylinux_2_28_{platform.machine()}", "-d", cache,
             f"torch-npu=={TORCH_NPU_VERSION}"],
            capture_output=True, text=True,
        )
        if download.returncode != 0 or not glob.glob(pattern):
            raise RuntimeError(
                f"cannot download torch-npu=={TORCH_NPU_VERSION} into {cache} (set {CACHE_VAR} to a "
                f"directory holding torch_npu-{TORCH_NPU_VERSION}-*.whl to work offline): "
                f"{download.stderr[-2000:]}"
            )
    return zipfile.ZipFile(sorted(glob.glob(pattern))[0])


def _entry_name(entry: object, where: str) -> str:
    """'add.Tensor' from '- add.Tensor' or '- func: add.Tensor(Tensor self, ...) -> Tensor'."""
    text = entry if isinstance(entry, str) else entry.get("func") if isinstance(entry, dict) else None
    match = re.match(r"\s*([\w.]+)", text or "")
    if match is None:
        raise ValueError(f"{where}: unexpected op entry {entry!r} (expected a name or a mapping with 'func')")
    return match.group(1)


def op_names_with_npu_kernel(archive: zipfile.ZipFile | None = None) -> frozenset[str]:
    """Aten op names with an NPU kernel in torch_npu, as 'name' (default overload) or 'name.overload'."""
    import yaml  # pyyaml: in the 'test' extra

    archive = archive or wheel()
    names: set[str] = set()
    for path in OP_LIST_FILES:
        document = yaml.safe_load(archive.read(path))
        for section in OP_SECTIONS:
            for entry in document.get(section) or ():
                names.add(_entry_name(entry, f"{archive.filename}:{path} section {section}"))
    if "mm" not in names or "npu_fusion_attention" not in names:
        raise ValueError(f"{archive.filename}: op lists {OP_LIST_FILES} changed format (no 'mm' entry)")
    return frozenset(names)


def module_names(wheel, member: str) -> set[str]:
    """Names a wheel module defines, imports or lists in __all__ (read, not imported)."""
    tree = ast.parse(wheel.read(member).decode())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return names
