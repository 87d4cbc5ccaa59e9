"""``npu-inject suite``: torchtitan's own integration suite through the runtime, as a capability matrix.

Runs each enabled case of upstream's ``tests/integration_tests`` (features, models) the way
upstream's driver does -- its ranks, its arguments, its sequence of runs (save, then resume),
through upstream's ``run_train.sh`` -- in the environment it is started in: ``TORCHTITAN_NPU=1``
on NPUs (real or simulated), ``TORCHTITAN_NPU=cpu`` for the rehearsal. The target decides
nothing else. Prints one row per case: green / red / stopped (one clear line at start-up) /
timeout, the time, the first and last loss, and for every other row its root cause in one
line, attributed (this project, torchtitan CUDA-only by design, torchtitan, torch, torch_npu,
CANN/hardware, host memory). Writes Markdown and JSON. In the rehearsal at upstream's shapes
(no ``--shrink``) each case's host memory is planned first (``npu-inject plan --hardware cpu``): a
case that would not fit this host is reported as ``memory`` without being started; the rehearsal's
own start-up check (the ``host_memory_check`` patch) is switched off in the suite's runs, which would
otherwise plan each case again.

Stdlib only. The case lists are upstream's own files, read from a torchtitan checkout (release/0.3):
``--torchtitan-src``, or ``TORCHTITAN_SRC``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from npu_inject.process_memory import process_tree_rss_kib
from npu_inject.torchtitan_argv import with_flags

SUITES = ("features", "models")
HOST_CHECK_OFF = "-host_memory_check"  # the host_memory_check patch, off in the suite's runs (without_host_check)
# Upstream's debug configs train 10 steps; --steps N scales a variant's own --training.steps by N/10.
UPSTREAM_STEPS = 10
UPSTREAM_LOCAL_BATCH = 8  # torchtitan's training.local_batch_size default, which the cases keep
UPSTREAM_MODULE, UPSTREAM_CONFIG = "llama3", "llama3_debugmodel"  # run_train.sh's MODULE and CONFIG defaults
# torchtitan's training metric line; its validator's "validate step: N  loss: L" is not a training step.
LOSS_LINE = re.compile(r"(?<!validate )step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*([-+0-9.naif]+)")
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)*((?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)\w*)): (.+)$")
# A rank's error that only says a peer failed first (its collective then fails): the cause is elsewhere.
PEER_FAILED = re.compile(r"The Inner error is reported as above.*operator name is hccl|"
                         r"Connection (?:closed|reset) by peer|HcclGetCommAsyncError")
FRAME_LINE = re.compile(r'File "([^"]+)", line \d+')
# One clear line at start-up: the runtime's configuration errors and model_guard's stops.
STOP_LINE = re.compile(r"(npu_inject model_guard: .+|npu_inject: configuration error: .+|"
                       r"(?:npu_inject\.errors\.)?ConfigError: .+)")
CUDA_ONLY = re.compile(r"\b(cuda|nccl|triton|helion|cutlass|sm_?90|hopper|nvidia)\b", re.IGNORECASE)
IGNORED_ERRORS = ("ChildFailedError", "SignalException")
RECIPES_MISSING = re.compile(r"Config function '[^']+' not found in torchtitan_recipes\.tests")
# torchtitan's config parser (tyro) reports bad arguments in a box, not as an exception.
PARSER_ERROR = re.compile(r"(Unrecognized or misplaced options|Required options|Invalid value for \S+|"
                          r"Config function '[^']+' not found[^\n]*|Error parsing [^\n│]*)")


@dataclasses.dataclass
class Case:
    suite: str
    name: str
    description: str
    ngpu: int
    runs: list[list[str]]  # each run's torchtitan arguments, in order
    timeout: int | None  # upstream's own limit, seconds (None: none)


@dataclasses.dataclass
class Result:
    suite: str
    name: str
    ngpu: int
    status: str  # green, red, stopped, timeout, memory
    seconds: float
    first_loss: float | None
    last_loss: float | None
    cause: str  # one line; '' when green
    attributed_to: str  # '' when green
    runs: int  # runs made (a resume case makes two)
    peak_rss_gib: float | None  # sum over the case's processes, highest sample
    shrunk: bool
    command: str  # the last run's command line
    planned_gib: float | None = None  # the rehearsal's host memory for all ranks, as npu-inject plan predicts it

    def row(self) -> str:
        loss = lambda value: "-" if value is None else f"{value:.4f}"  # noqa: E731
        cause = f"{self.cause} ({self.attributed_to})" if self.cause else ""
        mark = " (shrunk)" if self.shrunk else ""
        return (f"| {self.suite}/{self.name} | {self.ngpu} | {self.status}{mark} | {self.seconds:.0f} s | "
                f"{loss(self.first_loss)} | {loss(self.last_loss)} | {cause.replace('|', '/')} |")


# --suite name -> the builder function of upstream's tests/integration_tests/<name>.py
SUITES = {"features": "build_features_test_list", "models": "build_model_tests_list",
          "h100": "build_h100_tests_list"}


def load_cases(torchtitan_src: str, suites: Sequence[str]) -> list[Case]:
    """Upstream's enabled cases, read from its own case lists (``tests/integration_tests``)."""
    package = os.path.join(torchtitan_src, "tests", "integration_tests")
    if not os.path.isfile(os.path.join(package, "features.py")):
        raise SystemExit(f"npu-inject suite: {torchtitan_src!r} (--torchtitan-src or TORCHTITAN_SRC) has no "
                         "tests/integration_tests/features.py: give a torchtitan checkout (release/0.3)")
    sys.path.insert(0, os.path.abspath(torchtitan_src))
    try:
        cases = []
        for suite in suites:
            builder = SUITES[suite]
            module = importlib.import_module(f"tests.integration_tests.{suite}")
            for definition in getattr(module, builder)():
                if definition.disabled:
                    continue
                runs = [[token for arg in variant for token in shlex.split(arg)] for variant in definition.override_args]
                cases.append(Case(suite, definition.test_name, definition.test_descr, definition.ngpu, runs,
                                  definition.timeout))
        return cases
    finally:
        sys.path.remove(os.path.abspath(torchtitan_src))


def shorten(args: list[str], steps: int) -> list[str]:
    """The run's arguments for ``steps`` instead of upstream's 10, keeping what the case checks.

    A run's own ``--training.steps K`` (a resume to 20) becomes K * steps / 10, and a path naming
    upstream's last step (``.../step-10/``) names the shortened last step.
    """
    out, explicit = [], False
    for index, token in enumerate(args):
        previous = args[index - 1] if index else ""
        if previous == "--training.steps":
            token, explicit = str(max(1, int(token) * steps // UPSTREAM_STEPS)), True
        out.append(token.replace(f"step-{UPSTREAM_STEPS}/", f"step-{steps}/"))
    return out if explicit else with_flags(out, ["--training.steps", str(steps)])


def shrink(args: list[str], seq_len: int, local_batch: int) -> list[str]:
    """The run's arguments at a smaller shape: ``seq_len`` tokens, ``local_batch`` rows per rank.

    A run's own ``--training.global_batch_size G`` scales with the local batch (G * local_batch /
    the run's local batch, upstream's 8 unless it sets one), so a case accumulates gradients over
    as many microbatches as upstream's does, and no more.
    """
    value = lambda flag, default: int(args[args.index(flag) + 1]) if flag in args else default  # noqa: E731
    upstream_local = value("--training.local_batch_size", UPSTREAM_LOCAL_BATCH)
    out = list(args)
    if "--training.global_batch_size" in args:
        at = args.index("--training.global_batch_size") + 1
        scaled, remainder = divmod(int(args[at]) * local_batch, upstream_local)
        if remainder:
            raise ValueError(f"--shrink {seq_len},{local_batch}: global batch {args[at]} does not scale to a "
                             f"whole number for local batch {local_batch} (upstream's {upstream_local})")
        out[at] = str(scaled)
    return with_flags(out, ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(local_batch)])


def _run(command: list[str], env: dict[str, str], cwd: str, timeout: float | None, log_path: str
         ) -> tuple[int | None, str, int]:
    """(exit code or None on timeout, output, peak RSS KiB); the whole process group ends on timeout."""
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        started, peak, timed_out = time.monotonic(), 0, False
        while process.poll() is None:
            peak = max(peak, process_tree_rss_kib(process.pid))
            if timeout is not None and time.monotonic() - started > timeout:
                timed_out = True
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                break
            time.sleep(0.5)
        # A run that ended by itself is not a timeout, even if the clock passed the limit meanwhile.
        code = None if timed_out else process.returncode
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        return code, handle.read(), peak


def root_cause(output: str) -> tuple[str, str]:
    """(one line, who it is attributed to) for a failed run's output."""
    lines = output.splitlines()
    parser = PARSER_ERROR.search(output)
    if parser:
        missing = RECIPES_MISSING.search(parser.group(1))
        if missing:
            return (f"{missing.group(0)}: the torchtitan 0.3.0 wheel ships torchtitan_recipes.tests without its "
                    "configs; --torchtitan-src of a torchtitan checkout (with torchtitan_recipes/) supplies them",
                    "torchtitan (packaging)")
        return f"torchtitan's config parser: {parser.group(1)}"[:300], "torchtitan"
    errors = []  # (message, where) in output order
    for index, line in enumerate(lines):
        match = ERROR_LINE.match(line.strip())
        if not match or match.group(2) in IGNORED_ERRORS:
            continue
        frames = [m.group(1) for m in map(FRAME_LINE.search, lines[max(0, index - 80):index]) if m]
        errors.append((f"{match.group(2)}: {match.group(3)}"[:300], frames[-1] if frames else ""))
    if errors:
        # torchrun's summary lists the ranks in order, so a rank that only saw its peer fail can come first.
        message, where = next((error for error in errors if not PEER_FAILED.search(error[0])), errors[0])
        return message, attribute(where, message)
    aborted = re.search(r"^(?:\[rank(\d+)\]:)?terminate called[^\n]*", output, re.MULTILINE)
    if aborted:
        after = "after training completed" if "Training completed" in output else "during the run"
        return (f"rank {aborted.group(1) or '?'} aborted {after}: {aborted.group(0).split(':', 1)[-1].strip()} "
                "(a C++ thread or exception at exit, no Python traceback)")[:300], "unknown"
    if re.search(r"exitcode\s*:\s*-9|Signal 9|SIGKILL|Killed", output):
        return "a rank was killed (signal 9): out of host memory?", "host memory"
    tail = next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")
    return tail[:300], "unknown"


def attribute(path: str, message: str) -> str:
    if "/npu_inject/" in path or "npu_inject" in message:
        return "this project"
    if "/torch_npu/" in path or "torch_npu" in message:
        return "torch_npu"
    if re.search(r"\bacl\w*|\bCANN\b|EZ\d{4}|EE\d{4}", message):
        return "CANN/hardware"
    if "/torchtitan/" in path:
        return "torchtitan CUDA-only by design" if CUDA_ONLY.search(message) else "torchtitan"
    if "/torch/" in path:
        return "torch"
    return "unknown"


def with_checkout_recipes(torchtitan_src: str, workdir: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with a torchtitan checkout's ``torchtitan_recipes`` package, and only it, ahead of the
    installed one: some cases name configs in ``torchtitan_recipes.tests``, which the 0.3.0 wheel ships
    without them. Unchanged when ``torchtitan_src`` has no such package."""
    recipes = os.path.join(os.path.abspath(torchtitan_src), "torchtitan_recipes")
    if not os.path.isfile(os.path.join(recipes, "tests", "__init__.py")):
        return env
    shim = os.path.join(workdir, "recipes-path")
    os.makedirs(shim, exist_ok=True)
    if not os.path.islink(os.path.join(shim, "torchtitan_recipes")):
        os.symlink(recipes, os.path.join(shim, "torchtitan_recipes"))
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [shim, env.get("PYTHONPATH", "")]))}


def run_case(case: Case, args: argparse.Namespace, workdir: str, env: dict[str, str]) -> Result:
    output_dir = os.path.join(workdir, ARTIFACTS)  # upstream's relative checkpoint paths
    os.makedirs(output_dir, exist_ok=True)
    started, losses, peak, status, cause, who, command = time.monotonic(), {}, 0, "green", "", "", ""
    for number, run_args in enumerate(case.runs, start=1):
        run_args = shorten(run_args, args.steps) if args.steps else list(run_args)
        if args.shrink:
            run_args = shrink(run_args, *args.shrink)
        run_args = with_flags(run_args, ["--dump_folder", os.path.join(output_dir, case.name)])
        command = ["bash", args.run_train, *run_args]
        run_env = {**env, "NGPU": str(case.ngpu), "LOG_RANK": ",".join(map(str, range(case.ngpu)))}
        limit = args.case_timeout - (time.monotonic() - started)
        code, output, run_peak = _run(command, run_env, workdir, limit,
                                      os.path.join(workdir, f"{case.suite}-{case.name}-run{number}.log"))
        peak = max(peak, run_peak)
        # Pipeline ranks without the last stage log a placeholder loss of -1.
        run_losses = {int(step): float(value) for step, value in LOSS_LINE.findall(output) if float(value) >= 0}
        losses.update({(number, step): value for step, value in run_losses.items()})
        if code is None:
            status, cause, who = "timeout", f"ended at the per-case limit of {args.case_timeout} s (run {number})", "unknown"
            break
        if code != 0:
            stop = STOP_LINE.search(output)
            if stop and not run_losses:
                status, cause, who = "stopped", stop.group(1)[:300], "this project (a clear stop)"
            elif RECIPES_MISSING.search(output) and not run_losses:
                # torchtitan's own one line at start-up: the case's config is not in this torchtitan.
                status, (cause, who) = "stopped", root_cause(output)
            else:
                cause, who = root_cause(output)
                status = "memory" if who == "host memory" else "red"
                if status == "memory":
                    cause += f" (case peak RSS {peak / 2**20:.1f} GiB)"
            break
    ordered = [losses[key] for key in sorted(losses)]
    return Result(case.suite, case.name, case.ngpu, status, time.monotonic() - started,
                  ordered[0] if ordered else None, ordered[-1] if ordered else None, cause, who,
                  number, round(peak / 2**20, 2) if peak else None, bool(args.shrink),
                  portable_command(shlex.join(command)))


def plan_host_memory(case: Case, args: argparse.Namespace, workdir: str, env: dict[str, str]
                     ) -> tuple[dict[str, Any] | None, str]:
    """(``npu-inject plan --hardware cpu``'s host figures for the case's first run, or None; why not).

    The rehearsal runs every rank on this host: a case that would need more than it has is reported
    as ``memory`` before it starts, instead of being ended by the kernel's OOM killer minutes in.
    """
    run_args = shorten(case.runs[0], args.steps) if args.steps else list(case.runs[0])
    defaults = [*([] if "--module" in run_args else ["--module", UPSTREAM_MODULE]),
                *([] if "--config" in run_args else ["--config", UPSTREAM_CONFIG])]  # run_train.sh's
    path = os.path.join(workdir, f"{case.suite}-{case.name}-plan.json")
    plan_env = {name: value for name, value in env.items() if name != "TORCHTITAN_NPU"}
    command = [sys.executable, "-m", "npu_inject", "plan", "--hardware", "cpu", "--ngpu", str(case.ngpu),
               "--json", path, *defaults, *run_args]
    try:
        done = subprocess.run(command, env=plan_env, cwd=workdir, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return None, "npu-inject plan took over 900 s"
    if not os.path.isfile(path):
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("npu-inject plan:")]  # its one line, not a warning
        last = (said or lines or [f"exit {done.returncode}"])[-1]
        return None, f"could not plan it ({last[:200]})"
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["host"], ""


def without_host_check(selection: str) -> str:
    """``selection`` (TORCHTITAN_NPU_PATCHES) with the rehearsal's start-up host memory check off: the suite
    plans each case's host memory itself (:func:`plan_host_memory`; a --shrink case is small by design), so
    the check in each run would plan it again."""
    return f"{selection},{HOST_CHECK_OFF}" if selection.strip() else HOST_CHECK_OFF


# Path arguments of a recorded command line, written as variables: a matrix committed to the docs
# names no folder of the machine it ran on.
PATH_ARGUMENTS = {"--torchtitan-src": "$TORCHTITAN_SRC", "--run-train": "$TORCHTITAN_SRC/run_train.sh",
                  "--output": "$OUTPUT", "--assets": "$ASSETS"}


ARTIFACTS = "artifacts-to-be-uploaded"  # upstream's folder for a case's outputs, under --output


def portable_command(command: str) -> str:
    """``command`` with every machine path replaced: the suite's path arguments by variables,
    upstream's run_train.sh by ``$TORCHTITAN_SRC/run_train.sh``, paths into a case's outputs
    (dump folders, checkpoints) by the same path under ``$OUTPUT``."""
    words, previous = [], ""
    for word in shlex.split(command):
        if previous in PATH_ARGUMENTS:
            words.append(PATH_ARGUMENTS[previous])
        elif f"/{ARTIFACTS}/" in word:
            words.append("$OUTPUT" + word[word.index(f"/{ARTIFACTS}/"):])
        elif os.path.basename(word) == "run_train.sh":
            words.append(PATH_ARGUMENTS["--run-train"])
        else:
            words.append(shlex.quote(word))
        previous = word
    return " ".join(words)


def render_markdown(results: list[Result], meta: dict[str, Any]) -> str:
    counts = {status: sum(r.status == status for r in results) for status in ("green", "stopped", "red", "timeout", "memory")}
    lines = [
        f"torchtitan integration suite through npu-inject: target {meta['target']}, {meta['date']}, "
        f"npu_inject {meta.get('npu_inject_commit', 'unknown')}, {meta['machine']}; command: `{meta['command']}`",
        "",
        "| case | ranks | result | time | first loss | last loss | root cause (attributed to) |",
        "|---|---|---|---|---|---|---|",
        *(result.row() for result in results),
        "",
        "totals: " + ", ".join(f"{count} {status}" for status, count in counts.items()) + f" of {len(results)}"
        + (f" ({meta['cases_planned'] - len(results)} of {meta['cases_planned']} cases not run yet)"
           if meta.get("cases_planned", len(results)) > len(results) else ""),
    ]
    return "\n".join(lines)


def _write_matrix(workdir: str, results: list[Result], meta: dict[str, Any]) -> str:
    markdown = render_markdown(results, meta)
    with open(os.path.join(workdir, "matrix.md"), "w", encoding="utf-8") as handle:
        handle.write(markdown + "\n")
    with open(os.path.join(workdir, "matrix.json"), "w", encoding="utf-8") as handle:
        json.dump({"meta": meta, "cases": [dataclasses.asdict(result) for result in results]}, handle, indent=2)
    return markdown


def _checkout_commit() -> str:
    """The commit of the npu_inject checkout running the suite (with '+changes' when its tree differs),
    or why there is none: an installed wheel has no git history."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", package, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", package, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:
        return f"unknown (not a git checkout: {type(error).__name__})"
    return head + ("+changes" if dirty else "")


def cmd_suite(args: argparse.Namespace) -> int:
    target = os.environ.get("TORCHTITAN_NPU", "").strip()
    if target in ("", "0"):
        print("npu-inject suite: set TORCHTITAN_NPU (1 for NPUs, cpu for the rehearsal) in the environment "
              "the cases should run in", file=sys.stderr)
        return 2
    args.torchtitan_src = args.torchtitan_src or os.environ.get("TORCHTITAN_SRC", "")
    if not args.torchtitan_src:
        print("npu-inject suite: give --torchtitan-src (or set TORCHTITAN_SRC): a torchtitan checkout (release/0.3) "
              "holding tests/integration_tests and run_train.sh", file=sys.stderr)
        return 2
    args.run_train = os.path.abspath(args.run_train or os.path.join(args.torchtitan_src, "run_train.sh"))
    if not os.path.isfile(args.run_train):
        print(f"npu-inject suite: no run_train.sh at {args.run_train} (--run-train)", file=sys.stderr)
        return 2
    workdir = os.path.abspath(args.output)
    # Upstream's CI sets RUNNER_TEMP, which its case lists read to make the HF checkpoint path
    # absolute (torchtitan 0.3.0 refuses a relative initial_load_path): the same, in --output.
    os.environ["RUNNER_TEMP"] = workdir
    suites = args.suite.split(",")
    unknown_suites = sorted(set(suites) - set(SUITES))
    if unknown_suites:
        print(f"npu-inject suite: --suite {', '.join(unknown_suites)} is not one of {', '.join(SUITES)}",
              file=sys.stderr)
        return 2
    cases = load_cases(args.torchtitan_src, suites)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {case.name for case in cases})
        if unknown:
            print(f"npu-inject suite: unknown or disabled case(s) {', '.join(unknown)}; enabled: "
                  f"{', '.join(case.name for case in cases)}", file=sys.stderr)
            return 2
        cases = [case for case in cases if case.name in wanted]
    try:  # a --shrink some case cannot take is refused before anything runs
        for case in cases if args.shrink else ():
            for run_args in case.runs:
                shrink(run_args, *args.shrink)
    except ValueError as error:
        print(f"npu-inject suite: {error} (case {case.name})", file=sys.stderr)
        return 2
    if os.path.isdir(workdir) and os.listdir(workdir):
        print(f"npu-inject suite: {workdir} is not empty (--output needs a new or empty folder)", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(workdir, "tests"), exist_ok=True)
    # The cases read ./tests/assets (tokenizer, data sets, upstream's custom_schedule.csv).
    assets = os.path.join(workdir, "tests", "assets")
    shutil.copytree(os.path.abspath(args.assets), assets, symlinks=True)
    upstream_assets = os.path.join(args.torchtitan_src, "tests", "assets")
    for name in os.listdir(upstream_assets) if os.path.isdir(upstream_assets) else ():
        if not os.path.exists(os.path.join(assets, name)):
            shutil.copy(os.path.join(upstream_assets, name), assets)
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    env = with_checkout_recipes(args.torchtitan_src, workdir, env)
    if target == "cpu":
        env["TORCHTITAN_NPU_PATCHES"] = without_host_check(env.get("TORCHTITAN_NPU_PATCHES", ""))
    meta = {"target": "npu" if target in ("1", "npu") else target,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
            "simulated_npu": os.environ.get("TORCHTITAN_NPU_SIM") == "1",
            "npu_inject_commit": _checkout_commit(),
            "command": portable_command(shlex.join(["npu-inject", *sys.argv[1:]])) if sys.argv else "npu-inject suite",
            "steps": args.steps, "shrink": args.shrink, "case_timeout_s": args.case_timeout}
    results, began, markdown = [], time.monotonic(), ""
    for index, case in enumerate(cases, start=1):
        print(f"[{index}/{len(cases)}] {case.suite}/{case.name} ({case.ngpu} ranks, {len(case.runs)} run(s)); "
              f"{time.monotonic() - began:.0f} s elapsed", file=sys.stderr, flush=True)
        host, planned_gib = None, None
        if meta["target"] == "cpu" and not args.shrink and args.memory_check:
            host, why_not = plan_host_memory(case, args, workdir, env)
            if host is None:
                print(f"    memory check skipped: {why_not}", file=sys.stderr, flush=True)
            else:
                planned_gib = round(host["need_bytes"] / 2**30, 2)
        if host is not None and not host["fits"]:
            available = host["available_bytes"] / 2**30
            asked = host["asked_bytes"] / 2**30
            result = Result(case.suite, case.name, case.ngpu, "memory", 0.0, None, None,
                            f"planned to need about {planned_gib:.1f} GiB of host memory for its {case.ngpu} ranks "
                            f"({asked:.1f} with the plan's margin), {available:.1f} GiB available: not started "
                            "(npu-inject plan --hardware cpu; rehearse it with --shrink)", "host memory", 0, None,
                            False, "", planned_gib)
        else:
            result = dataclasses.replace(run_case(case, args, workdir, env), planned_gib=planned_gib)
        print(f"    {result.status} in {result.seconds:.0f} s" + (f": {result.cause}" if result.cause else ""),
              file=sys.stderr, flush=True)
        results.append(result)
        # Written after every case: a run stopped part way still leaves the matrix of what finished.
        markdown = _write_matrix(workdir, results, {**meta, "cases_planned": len(cases)})
    print(markdown)
    print(f"npu-inject suite: matrix in {workdir}/matrix.md and matrix.json; logs per run beside them")
    return 0 if all(result.status in ("green", "stopped") for result in results) else 1


def _shrink(value: str) -> tuple[int, int]:
    try:
        seq_len, batch = (int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shrink {value!r}: give SEQ_LEN,LOCAL_BATCH, e.g. 256,1") from None
    return seq_len, batch


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "suite", help="run torchtitan's integration suite through the runtime; print the capability matrix",
        description=__doc__.splitlines()[0] + " Exit 0 when every case is green or stops clearly.")
    parser.add_argument("--torchtitan-src", default="",
                        help="a torchtitan checkout (release/0.3) holding tests/integration_tests and run_train.sh "
                             "(default: $TORCHTITAN_SRC)")
    parser.add_argument("--suite", default="features,models", help="comma list of features, models, h100 (the advanced cases: async TP, dist_gemm, "
                             "MoE comm backends, float8, symmetric-memory FSDP) (default features,models)")
    parser.add_argument("--cases", default="", help="comma list of case names (default: every enabled case)")
    parser.add_argument("--steps", type=int, default=0,
                        help="train N steps instead of upstream's 10 (a resume case's second run scales alike)")
    parser.add_argument("--shrink", type=_shrink, default=None, metavar="SEQ_LEN,LOCAL_BATCH",
                        help="rehearse at a smaller shape (marked 'shrunk' in the matrix)")
    parser.add_argument("--case-timeout", type=int, default=1800, help="seconds per case, all its runs (default 1800)")
    parser.add_argument("--memory-check", action=argparse.BooleanOptionalAction, default=True,
                        help="in the rehearsal at upstream's shapes (no --shrink), plan each case's host memory "
                             "first (npu-inject plan --hardware cpu) and report a case that would not fit as "
                             "'memory' without starting it (default on)")
    parser.add_argument("--assets", default=os.path.join("tests", "assets"),
                        help="tokenizer and data sets the cases read as ./tests/assets (default ./tests/assets)")
    parser.add_argument("--run-train", default="", help="upstream's run_train.sh (default: beside --torchtitan-src's tests)")
    parser.add_argument("--output", required=True, help="a new or empty folder for logs, dumps and the matrix")
    parser.set_defaults(run=cmd_suite)
