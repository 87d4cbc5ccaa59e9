"""``npu-inject compare RUN_A RUN_B``: does run B train like reference run A did?

Reads the per-step loss and grad norm of two torchtitan runs, aligns them by step,
prints their relative differences and exits 1 when one passes ``--tolerance``.

A run is what users have at hand:

- a log file: torchrun's output saved to a file. torchtitan 0.3.0 prints
  ``step: N  loss: L  grad_norm: G ...`` (``MetricsProcessor.log``), with ANSI
  colours unless ``--metrics.disable_color_printing``, and torchrun may prefix
  lines with ``[rank0]:`` (``--tee``/``--local-ranks-filter``). Values are
  rounded as printed: loss to 5 decimals, grad norm to 4.
- TensorBoard event files (``--metrics.enable_tensorboard``; torchtitan depends on
  ``tensorboard``): tags ``loss_metrics/global_avg_loss`` and ``grad_norm`` at full
  float32 precision.
- JSONL: one JSON object per line, either flat (``{"step": 3, "loss": ..., "grad_norm": ...}``,
  or the metric names torchtitan hands its loggers) or torchtitan's structured trace
  records (``event_name``/``value``/``step``). torchtitan's own structured logs
  (``<dump>/structured_logs``) carry token counts, not losses, unless a user adds them.
- a dump folder: the sources above are looked for inside it, TensorBoard first (exact
  values), then JSONL, then logs (``*.log``, ``*.txt``, ``*.out``).

Nothing here imports torch or torchtitan; tensorboard is imported only to read event
files and matplotlib only for ``--plot``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from dataclasses import dataclass, field

from npu_inject.errors import ConfigError
from npu_inject.extras import install_hint

# 1: run B does not match A: a step past --tolerance, or steps / metrics missing from one run.
EXIT_OK, EXIT_MISMATCH = 0, 1
METRICS = ("loss", "grad_norm")
DEFAULT_TOLERANCE = 0.01
RELATIVE_DIFFERENCE = (
    "relative difference at a step = |B - A| / |A|, RUN_A being the reference "
    "(A = B = 0 counts 0; A = 0 != B counts infinite; a non-finite value counts 0 "
    "if both runs have the same one, otherwise infinite)"
)
# Names a metric goes by in JSONL and TensorBoard: ours, torchtitan's logger dict, common trackers.
METRIC_ALIASES = {
    "loss": ("loss", "loss_metrics/global_avg_loss", "train.loss", "train/loss"),
    "grad_norm": ("grad_norm", "train.grad_norm", "train/grad_norm"),
}
LOG_SUFFIXES = (".log", ".txt", ".out")

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
# torchrun's line prefixes: "[rank0]:" (--tee / --local-ranks-filter), "[default0]:" (older).
RANK_PREFIX = re.compile(r"^\s*\[(?:rank|default)(\d+)\]:")
# "validate step:" lines (the validator's loss) are not training steps.
METRIC_LINE = re.compile(
    rf"(?<![A-Za-z_])(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{NUMBER})"
    rf"(?:\s+grad_norm:\s*(?P<grad_norm>{NUMBER}))?"
)


class RunInputError(ConfigError):
    """A run cannot be read (missing path, no metrics, ambiguous source, malformed JSONL)."""


@dataclass
class RunMetrics:
    """metric name -> step -> value of one run, and where they came from."""

    path: str
    source: str  # the file actually read, with its kind
    values: dict[str, dict[int, float]]
    notes: list[str] = field(default_factory=list)

    def steps(self) -> list[int]:
        return sorted(set().union(*(series.keys() for series in self.values.values())))


# -- reading runs ---------------------------------------------------------------

def read_run(path: str, rank: int | None = None) -> RunMetrics:
    """Metrics of the run at ``path`` (log, JSONL, TensorBoard event file or dump folder)."""
    if not os.path.exists(path):
        raise RunInputError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        return _read_folder(path, rank)
    kind = _file_kind(path)
    run = _READERS[kind](path, rank)
    if not any(run.values.values()):
        raise RunInputError(
            f"{path}: no training metrics found in this {kind} file "
            f"(looked for {_what_is_looked_for(kind)})"
        )
    return run


def _file_kind(path: str) -> str:
    name = os.path.basename(path)
    if "tfevents" in name:
        return "tensorboard"
    if name.endswith(".jsonl"):
        return "jsonl"
    return "log"


def _what_is_looked_for(kind: str) -> str:
    return {
        "log": "torchtitan lines 'step: N  loss: L  grad_norm: G'",
        "jsonl": "objects with 'step' and one of "
        + ", ".join(repr(name) for names in METRIC_ALIASES.values() for name in names),
        "tensorboard": "scalar tags " + ", ".join(repr(name) for names in METRIC_ALIASES.values() for name in names),
    }[kind]


def _read_folder(folder: str, rank: int | None) -> RunMetrics:
    candidates = {
        "tensorboard": glob.glob(os.path.join(folder, "**", "*tfevents*"), recursive=True),
        "jsonl": glob.glob(os.path.join(folder, "**", "*.jsonl"), recursive=True),
        "log": [p for suffix in LOG_SUFFIXES for p in glob.glob(os.path.join(folder, "**", "*" + suffix), recursive=True)],
    }
    looked_at = []
    for kind in _READERS:
        runs = []
        for file_path in sorted(candidates[kind]):
            looked_at.append(file_path)
            run = _READERS[kind](file_path, rank)
            if any(run.values.values()):
                runs.append(run)
        if len(runs) == 1:
            run = runs[0]
            run.path = folder
            return run
        if len(runs) > 1:
            raise RunInputError(
                f"{folder}: several {kind} files hold training metrics, pass one of them instead: "
                + ", ".join(r.source.split(" ", 1)[1] for r in runs)
            )
    searched = ", ".join(os.path.relpath(p, folder) for p in looked_at) or "none found"
    raise RunInputError(
        f"{folder}: no training metrics in this folder (files searched: {searched}). torchtitan writes "
        "none to its dump folder by default: save torchrun's output (e.g. '... 2>&1 | tee "
        f"{os.path.join(folder, 'train.log')}') or train with --metrics.enable_tensorboard"
    )


def _read_log(path: str, rank: int | None) -> RunMetrics:
    # rank (None for unprefixed lines) -> metric -> step -> values in file order
    by_rank: dict[int | None, dict[str, dict[int, list[float]]]] = {}
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            line = ANSI_ESCAPE.sub("", line)
            match = METRIC_LINE.search(line)
            if match is None:
                continue
            prefix = RANK_PREFIX.match(line)
            line_rank = int(prefix.group(1)) if prefix else None
            series = by_rank.setdefault(line_rank, {name: {} for name in METRICS})
            step = int(match.group("step"))
            for name in METRICS:
                if match.group(name) is not None:
                    series[name].setdefault(step, []).append(float(match.group(name)))
    run = RunMetrics(path, f"log {path}", {name: {} for name in METRICS})
    if not by_rank:
        return run
    chosen = _choose_rank(path, sorted(by_rank, key=lambda r: -1 if r is None else r), rank, run.notes)
    for name, steps in by_rank[chosen].items():
        run.values[name] = _one_value_per_step(path, name, steps, run.notes)
    return run


def _choose_rank(path: str, ranks: list[int | None], wanted: int | None, notes: list[str]) -> int | None:
    prefixed = [r for r in ranks if r is not None]
    if wanted is not None:
        if wanted not in prefixed:
            raise RunInputError(
                f"{path}: --rank {wanted}: no metric lines with prefix [rank{wanted}]: "
                f"ranks present: {', '.join(map(str, prefixed)) or 'none (lines have no rank prefix)'}"
            )
        return wanted
    if len(prefixed) > 1:
        notes.append(f"{path}: read rank {prefixed[0]} of ranks {', '.join(map(str, prefixed))} (--rank picks another)")
    return prefixed[0] if prefixed else None


def _one_value_per_step(path: str, name: str, steps: dict[int, list[float]], notes: list[str]) -> dict[int, float]:
    # Every rank logs the same global values, so unprefixed duplicates are normally equal; different
    # ones mean a restarted run appended to the same file (or pipeline stages without the loss).
    chosen = {}
    conflicting = []
    for step, values in steps.items():
        if len({repr(v) for v in values}) > 1:
            conflicting.append(step)
        chosen[step] = values[-1]
    if conflicting:
        notes.append(
            f"{path}: {name} logged with different values at {len(conflicting)} step(s) "
            f"({_ranges(conflicting)}); the last value of each was used (a restarted run? ranks "
            "without rank prefixes?)"
        )
    return chosen


def _read_jsonl(path: str, rank: int | None) -> RunMetrics:
    run = RunMetrics(path, f"jsonl {path}", {name: {} for name in METRICS})
    names = {alias: metric for metric, aliases in METRIC_ALIASES.items() for alias in aliases}
    steps: dict[str, dict[int, list[float]]] = {name: {} for name in METRICS}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunInputError(f"{path}:{number}: not JSON ({exc.msg}, column {exc.colno})") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                continue
            if rank is not None and record.get("rank", rank) != rank:
                continue
            if "event_name" in record:  # torchtitan structured trace: one scalar per record
                pairs = [(record["event_name"], record.get("value"))]
            else:
                pairs = list(record.items())
            for key, value in pairs:
                metric = names.get(key)
                if metric is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    steps[metric].setdefault(record["step"], []).append(float(value))
    for name in METRICS:
        run.values[name] = _one_value_per_step(path, name, steps[name], run.notes)
    return run


def _read_tensorboard(path: str, rank: int | None) -> RunMetrics:
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as exc:
        raise RunInputError(
            f"{path}: reading TensorBoard events needs the tensorboard package "
            f"(pip install tensorboard; torchtitan depends on it): {exc}"
        ) from None
    events = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    tags = set(events.Tags().get("scalars", []))
    run = RunMetrics(path, f"tensorboard {path}", {name: {} for name in METRICS})
    for name, aliases in METRIC_ALIASES.items():
        tag = next((alias for alias in aliases if alias in tags), None)
        if tag is not None:
            run.values[name] = {event.step: float(event.value) for event in events.Scalars(tag)}
    return run


# In the order a dump folder is searched: exact values first.
_READERS = {"tensorboard": _read_tensorboard, "jsonl": _read_jsonl, "log": _read_log}


# -- comparing ------------------------------------------------------------------

def relative_difference(a: float, b: float) -> float:
    """|b - a| / |a|, a being the reference (see RELATIVE_DIFFERENCE for the edge cases)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        same = (math.isnan(a) and math.isnan(b)) or a == b
        return 0.0 if same else math.inf
    if a == 0.0:
        return 0.0 if b == 0.0 else math.inf
    return abs(b - a) / abs(a)


@dataclass
class MetricComparison:
    name: str
    steps: list[int]  # in both runs
    a: list[float]
    b: list[float]
    relative: list[float]
    tolerance: float

    @property
    def first_past_tolerance(self) -> int | None:
        return next((step for step, rel in zip(self.steps, self.relative) if rel > self.tolerance), None)

    @property
    def worst(self) -> tuple[float, int]:
        return max(zip(self.relative, self.steps), key=lambda pair: (pair[0], -pair[1]))

    @property
    def mean(self) -> float:
        return sum(self.relative) / len(self.relative)


def compare(run_a: RunMetrics, run_b: RunMetrics, metrics: tuple[str, ...], tolerance: float,
            allow_prefix: bool = False) -> tuple[list[MetricComparison], list[str], list[str]]:
    """Per-metric comparisons over the steps both runs have, notes, and what is missing.

    Missing (a failure): a requested metric absent from a run, and steps of a metric held by one
    run only, which is what a run that stopped early looks like. With ``allow_prefix`` the runs
    are compared up to the last step of the shorter one: steps after it, in the longer run only,
    become notes; a step missing before it is still missing.
    """
    notes = []
    missing = []
    comparisons = []
    for name in metrics:
        series_a, series_b = run_a.values[name], run_b.values[name]
        if not series_a or not series_b:
            lacking = " and ".join(label for label, series in (("A", series_a), ("B", series_b)) if not series)
            missing.append(f"{name}: not compared, run {lacking} has no {name} values "
                           f"(--metrics {','.join(m for m in metrics if m != name) or '...'} leaves it out)")
            continue
        common = sorted(set(series_a) & set(series_b))
        if not common:
            missing.append(f"{name}: not compared, no step in common (A: {_ranges(sorted(series_a))}, "
                         f"B: {_ranges(sorted(series_b))})")
            continue
        last_a, last_b = max(series_a), max(series_b)
        prefix_end = min(last_a, last_b)
        for label, mine, other, other_label in (("A", series_a, series_b, "B"), ("B", series_b, series_a, "A")):
            only = sorted(set(mine) - set(other))
            if not only:
                continue
            before_end = [s for s in only if s <= prefix_end]
            after_end = [s for s in only if s > prefix_end]
            if before_end:
                missing.append(f"{name}: steps only in {label}: {_ranges(before_end)} ({len(before_end)} steps), "
                               f"missing from run {other_label} although it goes on to step {max(other)}")
            if after_end and allow_prefix:
                notes.append(f"{name}: steps only in {label}, not compared (--allow-prefix): "
                             f"{_ranges(after_end)} ({len(after_end)} steps)")
            elif after_end:
                missing.append(
                    f"{name}: steps only in {label}: {_ranges(after_end)} ({len(after_end)} steps): run "
                    f"{other_label} ends at step {max(other)}, run {label} at step {max(mine)} (run "
                    f"{other_label} stopped early: crashed, killed, or given fewer --training.steps?); "
                    f"--allow-prefix compares the steps up to {max(other)} only"
                )
        a = [series_a[s] for s in common]
        b = [series_b[s] for s in common]
        comparisons.append(MetricComparison(name, common, a, b, [relative_difference(x, y) for x, y in zip(a, b)], tolerance))
    return comparisons, notes, missing


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts = []
    start = previous = steps[0]
    for step in steps[1:] + [None]:
        if step is not None and step == previous + 1:
            previous = step
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if step is not None:
            start = previous = step
    return ", ".join(parts)


# -- output ---------------------------------------------------------------------

def _table_steps(comparisons: list[MetricComparison], all_steps: bool) -> list[int]:
    steps = sorted(set().union(*(c.steps for c in comparisons)))
    if all_steps or len(steps) <= 20:
        return steps
    shown = set(steps[:5]) | set(steps[-5:])
    for c in comparisons:
        first = c.first_past_tolerance
        if first is not None:
            index = steps.index(first)
            shown.update(steps[max(0, index - 1):index + 3])
        shown.add(c.worst[1])
    return sorted(shown)


def format_table(comparisons: list[MetricComparison], all_steps: bool = False) -> list[str]:
    by_step = {c.name: dict(zip(c.steps, zip(c.a, c.b, c.relative))) for c in comparisons}
    header = f"{'step':>6}"
    for c in comparisons:
        header += f"  {c.name + ' A':>12}  {c.name + ' B':>12}  {'rel':>8} "
    lines = [header]
    previous = None
    for step in _table_steps(comparisons, all_steps):
        if previous is not None and step != previous + 1 and not all_steps:
            lines.append(f"{'...':>6}")
        row = f"{step:>6}"
        for c in comparisons:
            if step in by_step[c.name]:
                a, b, rel = by_step[c.name][step]
                row += f"  {a:12.6g}  {b:12.6g}  {rel:8.2e}{'*' if rel > c.tolerance else ' '}"
            else:
                row += f"  {'-':>12}  {'-':>12}  {'-':>8} "
        lines.append(row.rstrip())
        previous = step
    return lines


def format_summary(comparisons: list[MetricComparison], tolerance: float) -> list[str]:
    lines = [f"{'metric':10} {'steps':>5}  {'max rel (step)':>20}  {'mean rel':>9}  first step past {tolerance:g}"]
    for c in comparisons:
        worst, worst_step = c.worst
        first = c.first_past_tolerance
        lines.append(
            f"{c.name:10} {len(c.steps):>5}  {f'{worst:.2e} ({worst_step})':>20}  {c.mean:9.2e}  "
            f"{'-' if first is None else first}"
        )
    return lines


def write_plot(path: str, comparisons: list[MetricComparison], label_a: str, label_b: str, tolerance: float) -> None:
    # Figure without pyplot: no GUI backend, no global state (works headless).
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6 * len(comparisons), 6.5), layout="constrained")
    axes = figure.subplots(2, len(comparisons), sharex="col", squeeze=False, height_ratios=(2, 1))
    for column, c in enumerate(comparisons):
        curves, difference = axes[0][column], axes[1][column]
        curves.plot(c.steps, c.a, label=f"A: {label_a}", color="tab:blue", linewidth=1.8)
        curves.plot(c.steps, c.b, label=f"B: {label_b}", color="tab:orange", linewidth=1.2, linestyle="--")
        curves.set_title(c.name)
        curves.set_ylabel(c.name)
        curves.legend(fontsize="small")
        # An infinite difference (A = 0, or one run non-finite) cannot be drawn; the table shows it.
        drawable = [rel if math.isfinite(rel) else math.nan for rel in c.relative]
        difference.plot(c.steps, drawable, color="tab:red", marker="." if len(c.steps) <= 50 else None)
        difference.axhline(tolerance, color="gray", linestyle=":", label=f"tolerance {tolerance:g}")
        first = c.first_past_tolerance
        if first is not None:
            for ax in (curves, difference):
                ax.axvline(first, color="tab:red", alpha=0.4, linestyle="-.")
            difference.annotate(f"first past tolerance: step {first}", (first, tolerance),
                                xytext=(5, 5), textcoords="offset points", fontsize="small")
        difference.set_ylabel("|B - A| / |A|")
        difference.set_xlabel("step")
        difference.legend(fontsize="small")
        difference.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (curves, difference):
            ax.grid(alpha=0.3)
    figure.savefig(path, dpi=110)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RunInputError(f"--plot needs matplotlib: {install_hint('matplotlib')}") from None


# -- command --------------------------------------------------------------------

def cmd_compare(args) -> int:
    metrics = tuple(name.strip() for name in args.metrics.split(",") if name.strip())
    unknown = [name for name in metrics if name not in METRICS]
    if unknown or not metrics:
        raise RunInputError(f"--metrics {args.metrics!r}: valid names are {', '.join(METRICS)} (comma-separated)")
    if not args.tolerance >= 0:
        raise RunInputError(f"--tolerance {args.tolerance}: must be a number >= 0")
    if args.plot:
        _require_matplotlib()  # before reading runs: fail fast
    run_a, run_b = read_run(args.run_a, args.rank), read_run(args.run_b, args.rank)
    comparisons, notes, missing = compare(run_a, run_b, metrics, args.tolerance, args.allow_prefix)
    for label, run in (("A", run_a), ("B", run_b)):
        steps = run.steps()
        print(f"{label}: {run.source} ({len(steps)} steps, {_ranges(steps)})")
    for note in run_a.notes + run_b.notes:
        print(f"note: {note}")
    if not comparisons:
        raise RunInputError("nothing to compare: " + "; ".join(missing))
    print(f"rel = |B - A| / |A| (A: reference); * marks a step past --tolerance {args.tolerance:g}")
    print()
    for line in format_table(comparisons, args.all_steps):
        print(line)
    print()
    for line in format_summary(comparisons, args.tolerance):
        print(line)
    for note in notes:
        print(f"note: {note}")
    if args.plot:
        write_plot(args.plot, comparisons, args.run_a, args.run_b, args.tolerance)
        print(f"plot: {args.plot}")
    for problem in missing:
        print(f"INCOMPLETE: {problem}")
    diverged = [(c.first_past_tolerance, c) for c in comparisons if c.first_past_tolerance is not None]
    if diverged:
        step = min(first for first, _ in diverged)
        at_step = [c for first, c in diverged if first == step]
        details = ", ".join(f"{c.name} {c.a[c.steps.index(step)]:.6g} -> {c.b[c.steps.index(step)]:.6g}, "
                            f"rel {c.relative[c.steps.index(step)]:.2e}" for c in at_step)
        print(f"DIVERGED: first step past tolerance {args.tolerance:g}: step {step} ({details})")
    if diverged or missing:
        return EXIT_MISMATCH
    compared = sorted(set().union(*(c.steps for c in comparisons)))
    longest = max(len(run_a.steps()), len(run_b.steps()))
    scope = f"{len(compared)} steps compared ({_ranges(compared)})"
    if args.allow_prefix and len(compared) < longest:
        scope += f", a prefix comparison (--allow-prefix): {longest - len(compared)} later step(s) of the longer run not compared"
    print(f"OK: every compared step within tolerance {args.tolerance:g}; {scope}")
    return EXIT_OK


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``compare`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "compare",
        help="does run B train like reference run A? per-step loss / grad norm differences",
        description=(
            "Align two torchtitan runs by step and compare their loss and grad norm. A run is a log "
            "file (torchrun's output; ANSI colours and [rankN]: prefixes are fine), a TensorBoard "
            "event file, a JSONL file, or a dump folder holding one of them. "
            f"The {RELATIVE_DIFFERENCE}. Both runs must hold the same steps and every --metrics "
            "metric: a step or metric present in one run only (a run that crashed or was stopped "
            "early) fails, unless --allow-prefix. "
            "Exit 0: every step compared and within --tolerance; 1: a step past it (the first one is "
            "printed), or steps / metrics missing from one run (named); 2: a run cannot be read."
        ),
    )
    parser.add_argument("run_a", metavar="RUN_A", help="reference run (e.g. GPU or CPU rehearsal)")
    parser.add_argument("run_b", metavar="RUN_B", help="run checked against it (e.g. NPU)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"largest allowed |B - A| / |A| at any step (default {DEFAULT_TOLERANCE:g})")
    parser.add_argument("--metrics", default=",".join(METRICS),
                        help=f"comma-separated metrics to compare (default {','.join(METRICS)})")
    parser.add_argument("--rank", type=int, default=None,
                        help="read this rank's lines/records when a run has several (default: lowest)")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="write both curves and their relative difference to this PNG "
                        "(needs matplotlib: npu-inject's plot extra)")
    parser.add_argument("--allow-prefix", action="store_true",
                        help="compare the runs up to the last step of the shorter one (e.g. a short "
                        "NPU run against a long reference); the later steps of the longer run are "
                        "listed, not compared. A step missing before that point still fails")
    parser.add_argument("--all-steps", action="store_true",
                        help="print every compared step (default: up to 20 rows, long runs abridged)")
    parser.set_defaults(run=cmd_compare)
    return parser
