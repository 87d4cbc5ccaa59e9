"""The capability matrix in docs/suite.md (torchtitan's integration suite on each target, side by side)
and its counts, one line per target, in the README.

Rendered from the ``matrix.json`` files ``npu-inject suite`` writes, committed as
``docs/suite/<target>.json`` (one per target, copied from a whole-suite run's ``--output``, with every
machine path written as a variable); tests/unit/tools/test_suite_table.py checks the documents hold
exactly what ``render()`` and ``render_counts()`` give and that every enabled upstream case has a row.

Usage: python tools/suite_table.py                        # print the blocks
       python tools/suite_table.py --check | --write      # compare with / rewrite the documents' blocks
       python tools/suite_table.py --record TARGET DIR    # copy DIR/matrix.json to docs/suite/TARGET.json
                                                          # (TARGET h100/<target>: the advanced suite's block)
       python tools/suite_table.py --rerun TARGET DIR     # replace the rows DIR/matrix.json re-ran
       python tools/suite_table.py --record-parts full/rehearsal DIR [DIR ...]
                                                          # the rehearsal at upstream's shapes, run in parts:
                                                          # later parts add or replace cases
A re-run (cases run again after a fix) replaces those rows and is listed under the target with
its own date, commit and command, so every row says which run it comes from.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a script: the repository root holds tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import doc_blocks  # noqa: E402

DOC = os.path.join(doc_blocks.REPO, "docs", "suite.md")
README = os.path.join(doc_blocks.REPO, "README.md")
DATA = os.path.join(doc_blocks.REPO, "docs", "suite")
BEGIN, END = doc_blocks.markers("suite-matrix", "tools/suite_table.py")
COUNTS_BEGIN, COUNTS_END = doc_blocks.markers("suite-counts", "tools/suite_table.py")
# Column order and headings; a target's file is docs/suite/<key>.json.
TARGETS = {"rehearsal": "CPU rehearsal", "sim_npu": "simulated NPUs", "cann_emu": "real torch_npu on the CANN emulation"}
# Upstream's advanced suite (tests/integration_tests/h100.py, `npu-inject suite --suite h100`), its own
# block: docs/suite/h100/<target>.json.
H100_TARGETS = {"h100/rehearsal": "CPU rehearsal", "h100/sim_npu": "simulated NPUs",
                "h100/cann_emu": "real torch_npu on the CANN emulation"}
H100_BEGIN, H100_END = doc_blocks.markers("suite-h100", "tools/suite_table.py")
# The rehearsal at upstream's shapes (no --shrink): its host memory, planned before each case and measured.
FULL_TARGETS = {"full/rehearsal": "CPU rehearsal at upstream's shapes"}
FULL_BEGIN, FULL_END = doc_blocks.markers("suite-full-shape", "tools/suite_table.py")
STATUSES = ("green", "stopped", "red", "timeout", "memory")


def load(target: str) -> dict:
    path = os.path.join(DATA, f"{target}.json")
    with open(path, encoding="utf-8") as handle:
        matrix = json.load(handle)
    if not matrix.get("cases"):
        raise SystemExit(f"{path}: no cases (expected npu-inject suite's matrix.json)")
    return matrix


def _cell(case: dict | None) -> str:
    if case is None:
        return "not run"
    return f"{case['status']} {case['seconds']:.0f} s"


def _shape(meta: dict) -> str:
    parts = []
    if meta.get("steps"):
        parts.append(f"{meta['steps']} steps")
    if meta.get("shrink"):
        seq_len, batch = meta["shrink"]
        parts.append(f"shrunk to seq_len {seq_len}, local batch {batch}")
    return ", ".join(parts) or "upstream's shapes and steps"


def _counts(cases: list[dict]) -> str:
    return ", ".join(f"{sum(c['status'] == s for c in cases)} {s}" for s in STATUSES) + f" of {len(cases)}"


def render_counts() -> str:
    """One line per target for the README."""
    lines = [COUNTS_BEGIN]
    for target, heading in TARGETS.items():
        matrix = load(target)
        lines.append(f"- {heading}: {_counts(matrix['cases'])} ({matrix['meta']['date'][:10]}, "
                     f"{_shape(matrix['meta'])})")
    return "\n".join([*lines, COUNTS_END])


def render(targets: dict[str, str] = TARGETS, begin: str = BEGIN, end: str = END) -> str:
    matrices = {target: load(target) for target in targets}
    names: list[str] = []
    for matrix in matrices.values():
        names += [f"{c['suite']}/{c['name']}" for c in matrix["cases"] if f"{c['suite']}/{c['name']}" not in names]
    by_name = {target: {f"{c['suite']}/{c['name']}": c for c in matrix["cases"]}
               for target, matrix in matrices.items()}
    lines = [begin, ""]
    for target, heading in targets.items():
        meta, cases = matrices[target]["meta"], matrices[target]["cases"]
        lines.append(f"- **{heading}**: {_counts(cases)}. {meta['date']}, npu_inject "
                     f"{meta.get('npu_inject_commit', 'unknown')}, {meta['machine']}; {_shape(meta)}; "
                     f"`{meta['command']}`")
        for rerun in meta.get("reruns", ()):
            lines.append(f"  - re-run: {', '.join(rerun['cases'])}; {rerun['date']}, npu_inject "
                         f"{rerun.get('npu_inject_commit', 'unknown')}, {rerun['machine']}; `{rerun['command']}`")
    lines += ["", "| case | ranks | " + " | ".join(targets.values()) + " |",
              "|---|---|" + "---|" * len(targets)]
    for name in names:
        ranks = next(by_name[t][name]["ngpu"] for t in targets if name in by_name[t])
        lines.append(f"| {name} | {ranks} | " + " | ".join(_cell(by_name[t].get(name)) for t in targets) + " |")
    lines += ["", "Rows that are not green, with the root cause in one line (attributed to):", ""]
    for name in names:
        causes: dict[str, list[str]] = {}
        for target, heading in targets.items():
            case = by_name[target].get(name)
            if case is not None and case["status"] != "green":
                text = f"{case['status']}: {case['cause']} ({case['attributed_to']})"
                causes.setdefault(text, []).append(heading)
        for text, where in causes.items():
            lines.append(f"- {name} ({' and '.join(where)}) {text}")
    lines += ["", end]
    return "\n".join(lines)


def render_h100() -> str:
    return render(H100_TARGETS, H100_BEGIN, H100_END)


def plan_error(case: dict) -> float | None:
    """(planned - peak) / peak of the host memory, for a case that ran green with a plan; else None."""
    planned, peak = case.get("planned_gib"), case.get("peak_rss_gib")
    if not planned or not peak or case["status"] != "green":
        return None
    return (planned - peak) / peak


def plan_error_summary(cases: list[dict]) -> str:
    """The plan's error over the cases that ran, in one sentence: the one place docs state these figures."""
    from npu_inject.planner.host_memory import HOST_MARGIN

    errors = sorted(error for error in map(plan_error, cases) if error is not None)
    if not errors:
        return "No case ran green with a plan."
    worst_ratio = 1 / (1 + errors[0])  # peak / planned of the largest shortfall
    return (f"The plan's error, on the {len(errors)} cases that ran green with a plan: {errors[-1]:+.0%} to "
            f"{errors[0]:+.0%}, median {statistics.median(errors):+.0%}; the largest shortfall is the plan "
            f"x{worst_ratio:.2f}, inside the margin the verdict asks for (the plan x{HOST_MARGIN:g}, "
            f"`npu_inject/planner/host_memory.py`).")


def render_full() -> str:
    """The rehearsal at upstream's shapes: each case's host memory as planned (npu-inject plan --hardware cpu,
    before starting it) and as measured (the peak resident memory of all its processes), and the plan's error."""
    (target, heading), = FULL_TARGETS.items()
    matrix = load(target)
    meta, cases = matrix["meta"], matrix["cases"]
    lines = [FULL_BEGIN, "", f"- **{heading}**: {_counts(cases)}. {meta['date']}, npu_inject "
             f"{meta.get('npu_inject_commit', 'unknown')}, {meta['machine']}; {_shape(meta)}; `{meta['command']}`"]
    for part in meta.get("reruns", ()):
        lines.append(f"  - part: {', '.join(part['cases'])}; {part['date']}, npu_inject "
                     f"{part.get('npu_inject_commit', 'unknown')}, {part['machine']}; `{part['command']}`")
    lines += ["", "| case | ranks | result | planned host memory (GiB) | peak resident memory (GiB) | plan's error |",
              "|---|---|---|---|---|---|"]
    for case in cases:
        planned, peak, error = case.get("planned_gib"), case.get("peak_rss_gib"), plan_error(case)
        ran = case["status"] != "memory" or case.get("runs")
        lines.append(f"| {case['suite']}/{case['name']} | {case['ngpu']} | {_cell(case)} | "
                     f"{'' if planned is None else f'{planned:.1f}'} | {'' if peak is None or not ran else f'{peak:.1f}'} | "
                     f"{'' if error is None else f'{error:+.0%}'} |")
    lines += ["", plan_error_summary(cases), "", "Rows that are not green (attributed to):", ""]
    lines += [f"- {case['suite']}/{case['name']} {case['status']}: {case['cause']} ({case['attributed_to']})"
              for case in cases if case["status"] != "green"]
    return "\n".join([*lines, "", FULL_END])


def record_parts(target: str, output_dirs: list[str]) -> str:
    """A suite run made in parts (stopped, then the remaining cases): the first part's matrix, each later
    part's cases added or replacing the earlier row, and listed with its own date, commit and command."""
    if target not in FULL_TARGETS:
        raise SystemExit(f"--record-parts: target {target!r} is not one of {', '.join(FULL_TARGETS)}")
    parts = []
    for output_dir in output_dirs:
        with open(os.path.join(output_dir, "matrix.json"), encoding="utf-8") as handle:
            parts.append(json.load(handle))
    base = parts[0]
    for later in parts[1:]:
        if later["meta"].get("shrink") or later["meta"].get("steps") != base["meta"].get("steps"):
            raise SystemExit("--record-parts: every part must run at upstream's shapes with the first part's steps")
        replaced = {(case["suite"], case["name"]): case for case in later["cases"]}
        base["cases"] = [replaced.pop((case["suite"], case["name"]), case) for case in base["cases"]]
        base["cases"] += list(replaced.values())
        meta = later["meta"]
        base["meta"].setdefault("reruns", []).append(
            {"cases": [f"{case['suite']}/{case['name']}" for case in later["cases"]], "date": meta["date"],
             "npu_inject_commit": meta.get("npu_inject_commit", "unknown"), "machine": meta["machine"],
             "command": meta["command"]})
    os.makedirs(os.path.dirname(os.path.join(DATA, target)), exist_ok=True)
    return _write(target, base)


def portable(matrix: dict) -> dict:
    """``matrix`` with every recorded command's machine paths written as variables."""
    from npu_inject.commands.suite import portable_command

    meta = matrix["meta"]
    meta["command"] = portable_command(meta["command"])
    for rerun_meta in meta.get("reruns", ()):
        rerun_meta["command"] = portable_command(rerun_meta["command"])
    for case in matrix["cases"]:
        case["command"] = portable_command(case["command"])
    return matrix


def _write(target: str, matrix: dict) -> str:
    destination = os.path.join(DATA, f"{target}.json")
    with open(destination, "w", encoding="utf-8") as handle:
        json.dump(portable(matrix), handle, indent=2)
        handle.write("\n")
    return destination


def record(target: str, output_dir: str) -> str:
    """Copy a whole-suite run's matrix.json as the target's data file."""
    if target not in TARGETS and target not in H100_TARGETS:
        raise SystemExit(f"--record: target {target!r} is not one of {', '.join([*TARGETS, *H100_TARGETS])}")
    source = os.path.join(output_dir, "matrix.json")
    if not os.path.isfile(source):
        raise SystemExit(f"--record: no matrix.json in {output_dir} (npu-inject suite's --output)")
    os.makedirs(os.path.dirname(os.path.join(DATA, target)), exist_ok=True)
    with open(source, encoding="utf-8") as handle:
        return _write(target, json.load(handle))


def rerun(target: str, output_dir: str) -> str:
    """Replace the target's rows with those a later run of some cases made, recording that run."""
    base = load(target)
    with open(os.path.join(output_dir, "matrix.json"), encoding="utf-8") as handle:
        later = json.load(handle)
    if later["meta"]["target"] != base["meta"]["target"]:
        raise SystemExit(f"--rerun: {output_dir} ran target {later['meta']['target']!r}, "
                         f"docs/suite/{target}.json is {base['meta']['target']!r}")
    if later["meta"].get("shrink") != base["meta"].get("shrink") or later["meta"].get("steps") != base["meta"].get("steps"):
        raise SystemExit(f"--rerun: {output_dir} used other steps/shrink than docs/suite/{target}.json")
    replaced = {(case["suite"], case["name"]): case for case in later["cases"]}
    known = {(case["suite"], case["name"]) for case in base["cases"]}
    if not set(replaced) <= known:
        raise SystemExit(f"--rerun: cases not in the recorded run: {sorted(set(replaced) - known)}")
    base["cases"] = [replaced.get((case["suite"], case["name"]), case) for case in base["cases"]]
    meta = later["meta"]
    base["meta"].setdefault("reruns", []).append(
        {"cases": [f"{suite}/{name}" for suite, name in replaced], "date": meta["date"],
         "npu_inject_commit": meta.get("npu_inject_commit", "unknown"), "machine": meta["machine"],
         "command": meta["command"]})
    return _write(target, base)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in ("--record", "--rerun"):
        print((record if sys.argv[1] == "--record" else rerun)(sys.argv[2], sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) >= 4 and sys.argv[1] == "--record-parts":
        print(record_parts(sys.argv[2], sys.argv[3:]))
        sys.exit(0)
    sys.exit(doc_blocks.main_blocks([(render, DOC, BEGIN, END), (render_h100, DOC, H100_BEGIN, H100_END),
                                     (render_full, DOC, FULL_BEGIN, FULL_END),
                                     (render_counts, README, COUNTS_BEGIN, COUNTS_END)],
                                    __doc__.splitlines()[0]))
