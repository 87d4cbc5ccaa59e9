"""What the runtime costs at start-up, measured over repeated fresh interpreters.

Builds this project's wheel, installs it (regular, non-editable) into a scratch
virtual environment whose dependencies come from the current environment, and
prints medians for:

1. interpreter start-up without the .pth (baseline) vs. with it, runtime disabled, and the
   .pth's own processing time measured in-process (free of process-start noise);
2. start-up with the runtime enabled, before torchtitan is imported, plus which
   heavy modules (torch, wrapt, importlib.metadata) that imported (goal: none);
3. ``import torchtitan`` with the runtime enabled vs. disabled, and the runtime's
   own breakdown (wrapt import, activation, per-patch apply) from its report.

Usage: python tools/bench_startup.py [--runs 40]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = "npu_inject_bootstrap.pth"


def make_venv(workdir: str) -> tuple[str, str]:
    """A scratch venv with the wheel installed; deps resolve through a path-only .pth."""
    venv = os.path.join(workdir, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # A plain path line: the current env's packages become importable, but its own
    # .pth files (an editable npu_inject among them) are not processed.
    with open(os.path.join(site, "zz_deps.pth"), "w") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    wheels = os.path.join(workdir, "wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, REPO], check=True)
    wheel = glob.glob(os.path.join(wheels, "npu_inject-*.whl"))[0]
    # --target, not --prefix: with --prefix pip also uninstalls npu-inject from the *current* env.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel], check=True)
    if not os.path.exists(os.path.join(site, PTH)):
        raise SystemExit(f"bench: the wheel did not install {PTH} into {site}")
    return python, site


def timed_runs(python: str, code: str, env: dict, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([python, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
        samples.append((time.perf_counter() - started) * 1000.0)
    return samples


def interleaved(python: str, cases: dict[str, tuple[str, dict]], runs: int) -> dict[str, list[float]]:
    """Alternate the cases run by run so drift in machine load hits all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (code, env) in cases.items():
            samples[name] += timed_runs(python, code, env, 1)
    return samples


def describe(samples: list[float]) -> str:
    median = statistics.median(samples)
    mad = statistics.median(abs(s - median) for s in samples)
    return f"{median:8.2f} ms (MAD {mad:.2f}, n={len(samples)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--only-import", action="store_true", help="skip sections 1 and 2")
    args = parser.parse_args()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}
    enabled_env = {**base_env, "TORCHTITAN_NPU": "cpu"}
    workdir = tempfile.mkdtemp(prefix="npu_inject_bench_")
    try:
        python, site = make_venv(workdir)
        pth_path = os.path.join(site, PTH)
        parked = pth_path + ".parked"

        print(f"python {sys.version.split()[0]}, wheel installed in {site}")
        if not args.only_import:
            print("\n1. start-up, runtime disabled (TORCHTITAN_NPU unset):")
            os.rename(pth_path, parked)
            without = timed_runs(python, "pass", base_env, 3)  # warm the page cache
            without = interleaved(python, {"without": ("pass", base_env)}, args.runs)["without"]
            os.rename(parked, pth_path)
            with_pth = interleaved(python, {"with": ("pass", base_env)}, args.runs)["with"]
            # Second, interleaved pass: .pth toggled between runs, to cancel drift.
            paired_without, paired_with = [], []
            for _ in range(args.runs):
                os.rename(pth_path, parked)
                paired_without += timed_runs(python, "pass", base_env, 1)
                os.rename(parked, pth_path)
                paired_with += timed_runs(python, "pass", base_env, 1)
            print(f"   no .pth (baseline)      {describe(without + paired_without)}")
            print(f"   .pth, disabled          {describe(with_pth + paired_with)}")
            extra = statistics.median(with_pth + paired_with) - statistics.median(without + paired_without)
            print(f"   extra                   {extra:+8.3f} ms   (goal <= 0.1 ms; noise is the MAD above)")
            # The same cost without process-start noise: site.py processing the .pth, timed in-process.
            in_process = (
                "import site, statistics, time\n"
                "samples = []\n"
                "for _ in range(2000):\n"
                "    started = time.perf_counter_ns(); site.addpackage(%r, %r, set())\n"
                "    samples.append(time.perf_counter_ns() - started)\n"
                "print(statistics.median(samples) / 1e6)" % (site, PTH)
            )
            pth_ms = float(subprocess.run([python, "-c", in_process], env=base_env, capture_output=True,
                                          text=True, check=True).stdout)
            print(f"   .pth processing alone   {pth_ms:8.4f} ms   (site.addpackage in-process, median of 2000)")

            print("\n2. start-up, runtime enabled (TORCHTITAN_NPU=cpu), before torchtitan is imported:")
            enabled = interleaved(python, {"enabled": ("pass", enabled_env), "disabled": ("pass", base_env)}, args.runs)
            print(f"   disabled                {describe(enabled['disabled'])}")
            print(f"   enabled                 {describe(enabled['enabled'])}")
            print(f"   extra                   {statistics.median(enabled['enabled']) - statistics.median(enabled['disabled']):+8.3f} ms   (goal <= 2 ms)")
            probe = ("import sys; print(sorted(m for m in ('torch', 'wrapt', 'importlib.metadata', "
                     "'packaging', 'dataclasses', 'npu_inject.runtime') if m in sys.modules))")
            loaded = subprocess.run([python, "-c", probe], env=enabled_env, capture_output=True, text=True, check=True)
            print(f"   heavy modules imported  {loaded.stdout.strip()}   (goal: [])")

        print("\n3. import torchtitan (after torch is imported), runtime enabled vs disabled; breakdown of\n"
              "   import torchtitan.train with the modules outside torchtitan it imports preloaded:")
        code = "import torch, time; t = time.perf_counter(); import torchtitan.trainer; print((time.perf_counter() - t) * 1e3)"
        imports = {"disabled": [], "enabled": []}
        for _ in range(max(5, args.runs // 4)):
            for name, env in (("disabled", base_env), ("enabled", enabled_env)):
                out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=True)
                imports[name].append(float(out.stdout.strip().splitlines()[-1]))
        print(f"   disabled                {describe(imports['disabled'])}")
        print(f"   enabled                 {describe(imports['enabled'])}")
        # A patch applied at a trigger may import modules (torch._dynamo, torchtitan's loss) that
        # training imports anyway a moment later; that is not the runtime's cost. So the breakdown
        # is taken with the modules outside torchtitan that torchtitan.train imports already loaded.
        imports_code = ("import sys, json; before = set(sys.modules); import torchtitan.train; "
                        "print(json.dumps(sorted(set(sys.modules) - before)))")
        imported = {}
        for name, env in (("disabled", base_env), ("enabled", enabled_env)):
            out = subprocess.run([python, "-c", imports_code], env=env, capture_output=True, text=True, check=True)
            imported[name] = set(json.loads(out.stdout.strip().splitlines()[-1]))
        preload = sorted(m for m in imported["disabled"]
                         if m.split(".")[0] not in ("torchtitan", "npu_inject") and not m.startswith("__"))
        only_enabled = sorted(m for m in imported["enabled"] - imported["disabled"]
                              if not m.startswith(("npu_inject", "wrapt")))
        report_code = ("import importlib, json\n"
                       "skipped = 0\n"
                       f"for name in {preload!r}:\n"
                       "    try: importlib.import_module(name)\n"
                       "    except ImportError: skipped += 1  # C submodules, cython helpers: no finder\n"
                       "import torchtitan.train; from npu_inject import runtime; r = runtime.current().report\n"
                       "print(json.dumps({'timings': r.timings_ms, 'apply': {k: v.apply_ms for k, v in r.patches.items()}, "
                       "'skipped': skipped}))")
        breakdowns = []
        for _ in range(max(5, args.runs // 4)):
            out = subprocess.run([python, "-c", report_code], env=enabled_env, capture_output=True, text=True, check=True)
            breakdowns.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"   preloaded {len(preload) - breakdowns[0]['skipped']} modules "
              f"({breakdowns[0]['skipped']} not importable by name)")
        wrapt_ms = statistics.median(b["timings"]["wrapt_import"] for b in breakdowns)
        activate_ms = statistics.median(b["timings"]["activate"] for b in breakdowns)
        # install_hooks includes wrapt's import and the patches whose trigger ("torchtitan") fired at once.
        with open(os.path.join(REPO, "npu_inject", "registry.json"), encoding="utf-8") as handle:
            at_torchtitan = [patch_id for patch_id, entry in json.load(handle)["patches"].items()
                             if "torchtitan" in entry["triggers"]]
        hooks_ms = statistics.median(b["timings"]["install_hooks"] - b["timings"]["wrapt_import"]
                                     - sum(b["apply"].get(p, 0.0) for p in at_torchtitan) for b in breakdowns)
        at_torchtitan_ms = statistics.median(sum(b["apply"].get(p, 0.0) for p in at_torchtitan) for b in breakdowns)
        apply_ms = statistics.median(sum(b["apply"].values()) for b in breakdowns)
        print(f"   wrapt import            {wrapt_ms:8.2f} ms   (reported separately)")
        print(f"   activation              {activate_ms:8.2f} ms   (env, registries, entry points, selection, versions)")
        print(f"   hook registration       {hooks_ms:8.2f} ms")
        print(f"   all patch apply         {apply_ms:8.2f} ms")
        for patch_id in breakdowns[0]["apply"]:
            print(f"     {patch_id:22}{statistics.median(b['apply'][patch_id] for b in breakdowns):8.2f} ms")
        at_import_ms = activate_ms + hooks_ms + at_torchtitan_ms
        print(f"   at import torchtitan    {at_import_ms:8.2f} ms   (activation + hooks + patches triggered by "
              "torchtitan itself; goal <= 30 ms)")
        print(f"   runtime total w/o wrapt {activate_ms + hooks_ms + apply_ms:8.2f} ms   (also every patch's apply "
              "at its own trigger; goal <= 30 ms)")
        print(f"   modules only the enabled runtime imports (besides npu_inject, wrapt): {len(only_enabled)}")
        for name in only_enabled:
            print(f"     {name}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
