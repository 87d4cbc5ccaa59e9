"""Each default-on patch switched off alone, on the real torch_npu wheel (CANN emulation): does upstream's own
code then run on the NPU, or stop with one line?

With a patch off (``TORCHTITAN_NPU_PATCHES=-<id>``) torchtitan's own code path runs where the patch would
have replaced it: paths that never met the real wheel. One run per (patch, model): 2 ranks, 2 steps, seq 128,
local batch 1, fp32, deterministic; llama3's debug model (FSDP 2) and deepseek_v3's (expert parallel 2).
A row is ``green`` (trained, losses printed), ``stopped`` (one clear line at start-up: the runtime's
configuration error naming what the patch was needed for) or ``red`` (the first error, attributed to
who raised it, as ``npu-inject suite`` attributes it).

    python tools/switch_off_matrix.py                     # every default-on patch x both models, Markdown
    python tools/switch_off_matrix.py --patches rotary,rms_norm --models llama3 --json out.json

About 25 s a run on the project's 2-core machine (startup dominates): the whole matrix about 25 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from npu_inject import registry  # noqa: E402
from npu_inject.commands.suite import LOSS_LINE, STOP_LINE, root_cause  # noqa: E402
from verification.cann_emu import DEFAULT_VENV, cann_env  # noqa: E402

RUN = ["--training.steps", "2", "--training.seq_len", "128", "--training.local_batch_size", "1",
       "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42", "--debug.deterministic",
       "--training.mixed_precision_param", "float32"]
MODELS = {
    "llama3": ["--module", "llama3", "--config", "llama3_debugmodel"],
    "deepseek_v3": ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
                    "--parallelism.expert_parallel_degree", "2"],
}


def default_on_patches() -> list[str]:
    """The patches a plain ``TORCHTITAN_NPU=1`` run applies on an NPU, in the registry's order."""
    return [spec.id for spec in registry.load(entry_points=False).patches.values()
            if spec.default and "npu" in spec.runs_on]


def run(patch: str, model: str, python: str, workdir: Path) -> dict:
    env = cann_env({**os.environ, "TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_PATCHES": f"-{patch}",
                    "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "torchtitan.train", *MODELS[model], *RUN, "--dump_folder", str(workdir / f"{patch}-{model}")]
    started = time.monotonic()
    result = subprocess.run(command, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=900)
    losses = {int(step): float(value) for step, value in LOSS_LINE.findall(result.stdout)}
    status, cause, who = classify(result.returncode, result.stdout, bool(losses))
    return {"patch": patch, "model": model, "seconds": round(time.monotonic() - started, 1),
            "losses": [losses[step] for step in sorted(losses)], "status": status, "cause": cause, "attributed_to": who}


# CANN's own account of a refused argument (161002), which torch_npu prints after "call aclnnX failed":
# "AclNN_Parameter_Error(EZ1001): Tensor self not implemented for DT_COMPLEX64, should be in ...".
CANN_DETAIL = re.compile(r"AclNN_Parameter_Error\(EZ1001\): ([^\n]*?)(?:, should be in dtype support list|\n|$)")


def classify(returncode: int, output: str, trained: bool) -> tuple[str, str, str]:
    """(status, cause, who): green; stopped with one line at start-up (the runtime's configuration error,
    or torchtitan's own config check naming the flag); red with the first error, attributed, and CANN's
    reason when it gave one."""
    if returncode == 0:
        return "green", "", ""
    stop = STOP_LINE.search(output)
    if stop and not trained:
        return "stopped", stop.group(1)[:300], "this project (a clear stop)"
    cause, who = root_cause(output)
    if not trained and cause.startswith("torchtitan's config parser:"):
        return "stopped", cause, "torchtitan (its own config check, at start-up)"
    detail = CANN_DETAIL.search(output)
    if detail and "161002" in cause:
        cause = f"{cause}: {detail.group(1)}"
    return "red", cause, who


def markdown(rows: list[dict], models: list[str]) -> str:
    by_key = {(row["patch"], row["model"]): row for row in rows}
    patches = list(dict.fromkeys(row["patch"] for row in rows))
    def cell(row: dict | None) -> str:
        if row is None:
            return "not run"
        return f"{row['status']}" + (f" ({row['losses'][-1]:.4f})" if row["losses"] else "")

    lines = ["| patch off | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    lines += [f"| {patch} | " + " | ".join(cell(by_key.get((patch, model))) for model in models) + " |"
              for patch in patches]
    causes = [f"- {row['patch']} off, {row['model']}: {row['status']}: {row['cause']} ({row['attributed_to']})"
              for row in rows if row["status"] != "green"]
    return "\n".join(lines + ([""] + causes if causes else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patches", help="comma-separated patch ids (default: every default-on patch)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--python", default=str(REPO / DEFAULT_VENV / "bin" / "python"),
                        help="the emulation venv's python (bash verification/cann_emu/setup.sh)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--render", nargs="+", metavar="JSON",
                        help="print the Markdown of earlier --json files (later rows replace earlier ones) and exit")
    args = parser.parse_args()
    if args.render:
        merged = {}
        for path in args.render:
            merged.update({(row["patch"], row["model"]): row for row in json.loads(Path(path).read_text())})
        order = {patch: index for index, patch in enumerate(default_on_patches())}
        rows = sorted(merged.values(), key=lambda row: (order.get(row["patch"], 99), row["model"]))
        print(markdown(rows, [model for model in MODELS if any(row["model"] == model for row in rows)]))
        return 0
    known = default_on_patches()
    patches = args.patches.split(",") if args.patches else known
    models = args.models.split(",")
    unknown = sorted(set(patches) - set(known)) + sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"not a default-on patch or a model: {', '.join(unknown)} (patches: {', '.join(known)}; "
                     f"models: {', '.join(MODELS)})")
    rows = []
    with tempfile.TemporaryDirectory(prefix="switch_off_") as workdir:
        for patch in patches:
            for model in models:
                rows.append(run(patch, model, args.python, Path(workdir)))
                row = rows[-1]
                print(f"{patch} off, {model}: {row['status']} in {row['seconds']} s {row['cause'][:150]}",
                      file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows, models))
    return 0 if all(row["status"] in ("green", "stopped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
