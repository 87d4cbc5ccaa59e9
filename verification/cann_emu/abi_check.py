"""Checks that every symbol the torch_npu wheel's libraries need from torch resolves in this torch.

    .venv-cann/bin/python verification/cann_emu/abi_check.py [--torch-npu DIR]

For each .so of the installed torch_npu (the torchair ones too), the undefined dynamic symbols
(``nm -D --undefined-only``) are sorted into: defined by the wheel itself, by the C/C++ runtime
(libc, libm, libstdc++, libgcc_s, ld.so), by the Python interpreter (``Py*``/``_Py*``), CANN names
(the emulation's business), and everything else, which must be defined by torch's libraries
(``nm -D --defined-only`` over torch/lib/*.so). Prints the counts and exits 1 when any symbol is
left unresolved, naming it. Weak undefined symbols (``w``/``v``) may stay unresolved, as the dynamic
linker allows.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

SYSTEM_LIBS = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2",
               "libpthread.so.0", "libdl.so.2", "librt.so.1")
CANN_RE = re.compile(r"^(acl|Acl|Hccl|Msprof|rt[A-Z]|drv[A-Z]|_ZN\d*ge|_ZN\d*ascend|_ZN\d*atb|_ZNK\d*ge|"
                     r"(v?snprintf|strcpy|memcpy|memset|strcat|sprintf)_s$)")
PYTHON_RE = re.compile(r"^_?Py|^_Py")


def _nm(path: str, *flags: str) -> list[tuple[str, str]]:
    out = subprocess.run(["nm", "-D", *flags, path], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((parts[-2], parts[-1].split("@")[0]))
    return rows


def _system_lib(name: str) -> str | None:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(name + " ") and "x86-64" in line:
            return line.split("=>")[-1].strip()
    return None


def check(package: Path, torch_lib: Path) -> int:
    wheel_libs = sorted(str(p) for p in package.rglob("*.so"))
    wheel_defined = {sym for lib in wheel_libs for _, sym in _nm(lib, "--defined-only")}
    system_defined = set()
    for name in SYSTEM_LIBS:
        path = _system_lib(name)
        if path:
            system_defined |= {sym for _, sym in _nm(path, "--defined-only")}
    torch_defined = {sym for lib in glob.glob(str(torch_lib / "*.so*"))
                     for _, sym in _nm(lib, "--defined-only")}
    counts = {"wheel": 0, "system": 0, "python": 0, "cann": 0, "torch": 0, "weak": 0}
    unresolved: list[tuple[str, str]] = []
    for lib in wheel_libs:
        for kind, sym in _nm(lib, "--undefined-only"):
            if sym in wheel_defined:
                counts["wheel"] += 1
            elif sym in system_defined:
                counts["system"] += 1
            elif PYTHON_RE.match(sym):
                counts["python"] += 1
            elif CANN_RE.match(sym):
                counts["cann"] += 1
            elif sym in torch_defined:
                counts["torch"] += 1
            elif kind in ("w", "v"):
                counts["weak"] += 1
            else:
                unresolved.append((Path(lib).name, sym))
    print(f"torch_npu: {package}\ntorch libs: {torch_lib}")
    print("undefined symbols resolved by: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for lib, sym in unresolved:
        print(f"UNRESOLVED {lib}: {sym}")
    print(f"{len(unresolved)} unresolved")
    return 1 if unresolved else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-npu", help="torch_npu package directory (default: this Python's)")
    parser.add_argument("--torch-lib", help="torch/lib directory (default: this Python's torch)")
    args = parser.parse_args()
    def find(name: str) -> Path:
        spec = importlib.util.find_spec(name)  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"abi_check: {name} is not installed in {sys.executable}")
        return Path(list(spec.submodule_search_locations)[0])
    package = Path(args.torch_npu) if args.torch_npu else find("torch_npu")
    torch_lib = Path(args.torch_lib) if args.torch_lib else find("torch") / "lib"
    sys.exit(check(package, torch_lib))


if __name__ == "__main__":
    main()
