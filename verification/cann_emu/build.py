"""Builds the CANN emulation's shared libraries with the system g++.

    python verification/cann_emu/build.py [--torch-npu DIR] [--force]

Output in verification/cann_emu/build/ (git-ignored):
- ``libcann_emu.so``: everything the emulation implements (csrc/*.cpp), plus one stub for every other
  CANN function the installed torch_npu names (its dynamic imports and the names it looks up with
  dlsym at run time, read from its .so files): a stub prints ``<name> is not implemented by the CANN
  emulation`` and returns an error status, so an unimplemented call fails loudly by name and never
  silently succeeds.
- ``libascendcl.so``, ``libhccl.so``, ... (``LIBRARIES``): the file names torch_npu links against or
  dlopens, each empty but for ``DT_NEEDED libcann_emu.so``, so the dynamic linker and ``dlsym`` on
  their handles find the emulation's symbols.

A stamp (digest of the sources, the names and the flags) skips the build when nothing changed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BUILD = HERE / "build"
CORE = "libcann_emu.so"

# File names torch_npu needs: DT_NEEDED of libtorch_npu.so, _C and libtensorpipe.so (readelf -d), and
# the libraries its FunctionLoader / op-plugin dlopen by name (strings of libtorch_npu.so; ctypes in
# torch_npu/npu/__init__.py for libascend_hal.so; libhcomm.so for HcclGroupStart/End, which
# ProcessGroupHCCL looks up there; libmsprofiler.so for the profiler's aclprofWarmup/SetConfig/
# GetSupportedFeatures(V2)/RegisterDeviceCallback/MarkEx; libascend_dump.so for aclopStart/StopDumpArgs,
# the profiler's record_op_args). libatb.so stays absent on purpose: torch_npu loads
# libop_plugin_atb.so inside try/except, as on a CANN install without the NNAL package.
LIBRARIES = (
    "libascendcl.so",
    "libhccl.so",
    "libhcomm.so",
    "libacl_op_compiler.so",
    "libge_runner.so",
    "libgraph.so",
    "libacl_tdt_channel.so",
    "libopapi.so",
    "libnnopbase.so",
    "libascend_hal.so",
    "libmsprofiler.so",
    "libascend_dump.so",
)

# CANN function names as torch_npu spells them (C identifiers, not parts of mangled C++ names).
NAME_RE = re.compile(
    rb"(?<![A-Za-z0-9_])("
    rb"acl(?:nn|rt|op|mdl|prof|sys|tdt)?[A-Z][A-Za-z0-9_]*"
    rb"|Acl[A-Z][A-Za-z0-9_]*"
    rb"|Hccl[A-Z][A-Za-z0-9_]*"
    rb"|Msprof[A-Z][A-Za-z0-9_]*"
    rb"|rt[A-Z][A-Za-z0-9]*"
    rb"|drv[A-Z][A-Za-z0-9_]*"
    rb")(?![A-Za-z0-9_])"
)
OP_TABLE = HERE / "op_table.json"
# Operators left out of the libraries on purpose (no stub either), so torch_npu's availability probe
# answers "absent" and it takes the documented operator, as on a CANN that lacks them. Each has no
# public signature (neither CANN's headers nor its documents), so it could only be guessed.
NOT_EXPORTED = {
    "aclnnTopkV2": "undocumented; torch_npu falls back to aclnnTopk (hicann/ops-math math/top_k_v2 documents aclnnTopk)",
}
# aclDataType values (hicann/runtime include/external/acl/acl_base_rt.h), by the names CANN's documents use.
ACL_DTYPES = {
    "FLOAT": 0, "FLOAT16": 1, "INT8": 2, "INT32": 3, "UINT8": 4, "INT16": 6, "UINT16": 7, "UINT32": 8,
    "INT64": 9, "UINT64": 10, "DOUBLE": 11, "BOOL": 12, "STRING": 13, "COMPLEX64": 16, "COMPLEX128": 17,
    "BFLOAT16": 27, "INT4": 29, "UINT1": 30, "COMPLEX32": 33, "HIFLOAT8": 34, "FLOAT8_E5M2": 35,
    "FLOAT8_E4M3FN": 36, "FLOAT8_E8M0": 37,
}
ENGINES = ("AiCore", "AiCpu")
CXXFLAGS = ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"]


def torch_npu_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("torch_npu")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "cann_emu build: torch_npu is not installed in this Python "
            f"({sys.executable}); run verification/cann_emu/setup.sh or pass --torch-npu DIR"
        )
    return Path(list(spec.submodule_search_locations)[0])


def wheel_libraries(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*.so") if "torchair" not in p.parts)


def cann_names(package: Path) -> set[str]:
    """CANN function names the wheel's libraries import or look up by name."""
    names: set[str] = set()
    for lib in wheel_libraries(package):
        names.update(m.decode() for m in NAME_RE.findall(lib.read_bytes()))
    return names


def version_key(version: str) -> tuple:
    """'9.1.0' < '9.1.0.1' < '9.2.0'; a part that is not a number ('RC1') sorts after the numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in version.split("."))


def variant_applies(variant: dict, soc: str, cann: str | None) -> bool:
    """Whether a row's variant speaks for SoC soc at CANN version cann (None: at any version)."""
    if not soc.startswith(variant.get("soc", "")):
        return False
    below = variant.get("cann_below")
    return below is None or cann is None or version_key(cann) < version_key(below)


def _check_dtypes(where: str, args: dict) -> None:
    for arg, dtypes in args.items():
        unknown = [d for d in dtypes if d not in ACL_DTYPES]
        if unknown:
            raise SystemExit(f"{where}.{arg}: unknown dtypes {unknown} (known: {sorted(ACL_DTYPES)})")


def load_op_table(path: Path = OP_TABLE) -> dict[str, dict]:
    """op_table.json without its '_about', checked: every field present, dtypes and engines known, each
    variant's condition and source given, and every real-machine report ('observed') agreeing with the
    lists that speak for its SoC: where a report and a document disagree, the report wins for its SoC."""
    table = {name: entry for name, entry in json.loads(path.read_text()).items() if not name.startswith("_")}
    for name, entry in table.items():
        where = f"{path.name}: {name}"
        missing = {"args", "formats", "engine", "source", "verified"} - set(entry)
        if missing:
            raise SystemExit(f"{where}: missing {sorted(missing)}")
        if entry["engine"] not in ENGINES:
            raise SystemExit(f"{where}: engine {entry['engine']!r} is not one of {ENGINES}")
        _check_dtypes(where, entry["args"])
        for i, variant in enumerate(entry.get("variants", [])):
            at = f"{where}: variants[{i}]"
            if not {"soc", "cann_below"} & set(variant) or not variant.get("source") or not variant.get("args"):
                raise SystemExit(f"{at}: a variant needs 'soc' (a SoC name prefix, e.g. 'Ascend950') and/or "
                                 "'cann_below' (e.g. '9.1.0'), 'args' and the 'source' that says so")
            extra = set(variant["args"]) - set(entry["args"])
            if extra:
                raise SystemExit(f"{at}: args {sorted(extra)} are not the row's arguments {sorted(entry['args'])}")
            _check_dtypes(at, variant["args"])
        for i, seen in enumerate(entry.get("observed", [])):
            at = f"{where}: observed[{i}]"
            if not str(seen.get("source", "")).startswith("https://") or not seen.get("refused"):
                raise SystemExit(f"{at}: a report needs 'refused' ({{argument: [dtypes]}}) and its 'source' (a URL)")
            if seen.get("soc") is None:
                continue  # the report does not say which SoC: it corroborates, it binds no list
            for arg, refused in seen["refused"].items():
                for args in lists_for(entry, arg, seen["soc"], seen.get("cann")):
                    wrong = sorted(set(refused) & set(args[arg]))
                    if wrong:
                        raise SystemExit(
                            f"{at}: {arg} lists {wrong}, which a real {seen['soc']} refused ({seen['source']}): "
                            f"a real machine's report wins for its SoC (and CANN version, 'cann'), so remove them "
                            f"from the lists that speak for {seen['soc']} (move what another SoC or release "
                            f"accepts to a 'variants' entry with its source)")
    return table


def lists_for(entry: dict, arg: str, soc: str, cann: str | None) -> list[dict]:
    """The row's lists the emulation may use for arg on SoC soc: at CANN version cann the first variant
    naming arg that applies, else the row's own; at an unknown version (None) every one that can apply."""
    chosen = []
    for variant in entry.get("variants", []):
        if arg in variant["args"] and variant_applies(variant, soc, cann):
            chosen.append(variant["args"])
            if cann is not None or "cann_below" not in variant:
                return chosen  # it speaks for soc at this (or every) version: the row's own list never does
    return [*chosen, entry["args"]]


def op_table_source(table: dict[str, dict]) -> str:
    """C++ for the table: cann_emu::op_arg_dtypes and cann_emu::op_engine (declared in csrc/cann_emu.h).
    Each operator's variants come first, in the table's order, its own lists last (soc "", cann_below "")."""
    arrays, rows, engines = [], [], []
    for i, (name, entry) in enumerate(sorted(table.items())):
        engines.append(f'    {{"{name}", "{entry["engine"]}"}},')
        lists = [(v.get("soc", ""), v.get("cann_below", ""), v["args"]) for v in entry.get("variants", [])]
        for k, (soc, below, args) in enumerate([*lists, ("", "", entry["args"])]):
            for j, (arg, dtypes) in enumerate(args.items()):
                arrays.append(f"const int k{i}_{k}_{j}[] = {{{', '.join(str(ACL_DTYPES[d]) for d in dtypes)}}};")
                rows.append(f'    {{"{name}", "{arg}", "{soc}", "{below}", k{i}_{k}_{j}, {len(dtypes)}}},')
    return (
        "// Generated by verification/cann_emu/build.py from op_table.json.\n"
        "#include <cstring>\n\nnamespace cann_emu {\n"
        "bool cann_version_below(const char* version, const char* bound);  // runtime.cpp\n"
        "namespace {\n"
        + "\n".join(arrays)
        + "\nstruct Row { const char* op; const char* arg; const char* soc; const char* cann_below; const int* dtypes; "
        "int n; };\n"
        "const Row kRows[] = {\n" + "\n".join(rows) + "\n};\n"
        "struct Engine { const char* op; const char* engine; };\n"
        "const Engine kEngines[] = {\n" + "\n".join(engines) + "\n};\n}  // namespace\n\n"
        "bool op_arg_dtypes(const char* op, const char* arg, const char* soc, const char* cann, const int** dtypes,\n"
        "                   int* n) {\n"
        "    for (const Row& r : kRows)\n"
        "        if (!std::strcmp(r.op, op) && !std::strcmp(r.arg, arg) &&\n"
        "            !std::strncmp(soc, r.soc, std::strlen(r.soc)) &&\n"
        "            (!*r.cann_below || cann_version_below(cann, r.cann_below))) {\n"
        "            *dtypes = r.dtypes;\n            *n = r.n;\n            return true;\n        }\n"
        "    return false;\n}\n"
        "const char* op_engine(const char* op) {\n"
        "    for (const Engine& e : kEngines) if (!std::strcmp(e.op, op)) return e.engine;\n"
        "    return nullptr;\n}\n}  // namespace cann_emu\n"
    )


def torch_dirs() -> tuple[Path, Path]:
    """(include, lib) of this Python's torch: csrc/aten_*.cpp compile against ATen, libcann_emu.so links it."""
    spec = importlib.util.find_spec("torch")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"cann_emu build: torch is not installed in {sys.executable}")
    root = Path(list(spec.submodule_search_locations)[0])
    return root / "include", root / "lib"


def defined_symbols(objects: list[Path]) -> set[str]:
    out = subprocess.run(["nm", "-g", "--defined-only", *map(str, objects)], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if len(line.split()) == 3}


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"cann_emu build: {' '.join(cmd)} failed:\n{result.stderr[-4000:]}")


def build(package: Path, force: bool = False) -> Path:
    sources = sorted(CSRC.glob("*.cpp"))
    headers = sorted(CSRC.glob("*.h"))
    names = sorted(cann_names(package))
    digest = hashlib.sha256()
    for path in (*sources, *headers, Path(__file__), OP_TABLE):
        digest.update(path.read_bytes())
    digest.update("\n".join(names).encode())
    digest.update(" ".join(CXXFLAGS).encode())
    digest.update(str(torch_dirs()).encode())
    stamp = BUILD / "stamp"
    if not force and stamp.exists() and stamp.read_text() == digest.hexdigest() and all(
        (BUILD / lib).exists() for lib in (CORE, *LIBRARIES)
    ):
        return BUILD
    BUILD.mkdir(exist_ok=True)
    table_src = BUILD / "op_table.cpp"
    table_src.write_text(op_table_source(load_op_table()))
    torch_include, torch_lib = torch_dirs()

    def compile_one(src: Path) -> Path:
        obj = BUILD / (src.stem + ".o")
        aten = ["-isystem", str(torch_include)] if src.name.startswith("aten_") else []
        run(["g++", *CXXFLAGS, *aten, f"-I{CSRC}", "-c", str(src), "-o", str(obj)])
        return obj

    # One g++ per core: the ATen files take most of the build (minutes on a 2-core machine, in every CI run).
    # The largest start first, so no long compile starts last; the link keeps the sources' order (and with it
    # the order of their static initialisers).
    in_order = (*sources, table_src)
    largest_first = sorted(in_order, key=lambda src: -src.stat().st_size)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        built = dict(zip(largest_first, pool.map(compile_one, largest_first)))
    objects = [built[src] for src in in_order]
    implemented = defined_symbols(objects)
    absent = {n for op in NOT_EXPORTED for n in (op, op + "GetWorkspaceSize")}
    missing = [n for n in names if n not in implemented and n not in absent]
    stubs = BUILD / "stubs.cpp"
    stubs.write_text(
        "// Generated by verification/cann_emu/build.py: CANN functions torch_npu names that the\n"
        "// emulation does not implement. Each fails loudly by name.\n"
        "namespace cann_emu { int unimplemented(const char* name); }\n"
        + "".join(
            f'extern "C" __attribute__((visibility("default"))) int {n}(...) '
            f'{{ return cann_emu::unimplemented("{n}"); }}\n'
            for n in missing
        )
    )
    (BUILD / "stub_names.txt").write_text("".join(n + "\n" for n in missing))
    stub_obj = BUILD / "stubs.o"
    run(["g++", "-O0", "-fPIC", "-c", str(stubs), "-o", str(stub_obj)])
    core = BUILD / CORE
    run(["g++", "-shared", "-o", str(core), *map(str, objects), str(stub_obj), f"-Wl,-soname,{CORE}",
         f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}", "-lpthread"])
    empty = BUILD / "empty.cpp"
    empty.write_text("// The named CANN libraries carry no code: DT_NEEDED libcann_emu.so serves their symbols.\n")
    for lib in LIBRARIES:
        run(["g++", "-shared", "-fPIC", "-o", str(BUILD / lib), str(empty), f"-Wl,-soname,{lib}",
             "-Wl,--no-as-needed", f"-L{BUILD}", "-lcann_emu", "-Wl,-rpath,$ORIGIN"])
    stamp.write_text(digest.hexdigest())
    print(f"cann_emu: built {BUILD} ({len(implemented & set(names))} of {len(names)} named functions "
          f"implemented, {len(missing)} stubs)")
    return BUILD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-npu", help="torch_npu package directory (default: the one this Python finds)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    args = parser.parse_args()
    build(torch_npu_dir(args.torch_npu), force=args.force)


if __name__ == "__main__":
    main()
