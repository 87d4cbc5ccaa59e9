"""``npu-inject`` / ``python -m npu_inject``: list, show, check, doctor (and the commands of their own modules).

Nothing here imports torch, torchtitan or wrapt, nor activates the runtime:
targets are checked by reading the installed torchtitan's source with :mod:`ast`,
and torch_npu is probed in a child process, so ``doctor`` works even where
importing torchtitan would fail (no triton, no NPU, no CANN).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import sys
import textwrap
from typing import Any, Iterable

from npu_inject import selection as selection_mod
from npu_inject import registry as registry_mod
from npu_inject import settings as settings_mod
from npu_inject.errors import ConfigError
from npu_inject.module_facts import module_source, split_target
from npu_inject.module_facts import read as read_module_facts

EXIT_OK, EXIT_ERROR = 0, 2
DOCTOR_DISTRIBUTIONS = ("torch", "torchtitan", "torch_npu", "triton", "triton-ascend", "wrapt")


NO_TARGET = (
    f"off ({settings_mod.ENV_TARGET} unset or 0): no patch applies. 'on when set': applies with "
    f"{settings_mod.ENV_TARGET}=1 (npu) or cpu; 'on for cpu' / 'on for npu': with that target only"
)


def _state(selection: selection_mod.Selection, patch_id: str) -> str:
    """'on' (would apply at its trigger), 'off', or 'off (why)' when not by selection. With no target
    (TORCHTITAN_NPU unset or 0) nothing applies: what the selection enables is 'on when set', or
    'on for <target>' when the patch runs on one target only."""
    state, reason = selection.initial[patch_id]
    reason = reason.removeprefix("off: ")  # shown as "off (...)"
    if state == selection_mod.NOT_APPLICABLE:  # the reason's install line is in `show` and doctor
        missing = selection_mod.missing_packages(selection.registry.patches[patch_id])
        return f"n/a ({', '.join(missing)} not installed)"
    if state == "pending":
        if selection.target is not None:
            return "on"
        runs_on = selection.registry.patches[patch_id].runs_on
        if set(registry_mod.TARGET_KINDS) <= set(runs_on):
            return "on when set"
        return "on for " + " or ".join(runs_on)
    return "off" if reason == "off by selection" else f"off ({reason})"


LIST_OPTIONAL = ("triggers", "supports")  # left out, in this order, where the terminal is too narrow
MIN_DESCRIPTION = 40  # the description's width kept before leaving an optional column out


def fit_table(headers: tuple[str, ...], rows: list[tuple[str, ...]], width: int) -> tuple[list[str], list[str]]:
    """The table's lines within ``width`` columns, and the optional columns left out to get there.

    Columns of LIST_OPTIONAL go first (while the others leave the last column under MIN_DESCRIPTION),
    then the widest cells wrap until the table fits; a word longer than its column is not broken."""
    natural = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    kept = list(range(len(headers)))
    dropped = []
    for name in LIST_OPTIONAL:
        fixed = sum(natural[i] + 2 for i in kept[:-1])
        if fixed + min(MIN_DESCRIPTION, natural[kept[-1]]) <= width:
            break
        kept.remove(headers.index(name))
        dropped.append(name)
    available = width - 2 * (len(kept) - 1)
    cap = max(natural[i] for i in kept)
    while cap > 10 and sum(min(natural[i], cap) for i in kept) > available:
        cap -= 1
    widths = [min(natural[i], cap) for i in kept]
    lines = []
    for row in (headers, *rows):
        cells = [textwrap.wrap(row[i], width=w, break_long_words=False, break_on_hyphens=False) or [""]
                 for i, w in zip(kept, widths)]
        for depth in range(max(len(cell) for cell in cells)):
            parts = [(cell[depth] if depth < len(cell) else "").ljust(w) for cell, w in zip(cells, widths)]
            lines.append("  ".join(parts).rstrip())
    return lines, dropped


def _supports_text(spec: registry_mod.PatchSpec) -> str:
    return ", ".join(f"{dist}{specifier}" for dist, specifier in spec.supports.items())


def cmd_list(args) -> int:
    selection = selection_mod.make()  # what this environment would make a run do
    registry = selection.registry
    problems = module_problems(registry.patches.values())  # each row shows its module's docstring
    if problems:
        return _print_problems(problems)
    rows = [{**spec.to_json(), "state": _state(selection, patch_id)} for patch_id, spec in registry.patches.items()]
    if args.json:
        print(json.dumps({"target": selection.target, "patches": rows}, indent=2))
        return EXIT_OK
    headers = ("id", "state", "default", "triggers", "supports", "description")
    table = [
        (r["id"], r["state"], "on" if r["default"] else "off", ", ".join(r["triggers"]),
         _supports_text(registry.patches[r["id"]]), r["description"])
        for r in rows
    ]
    width = shutil.get_terminal_size().columns
    lines, dropped = fit_table(headers, table, width)
    print("\n".join(textwrap.wrap(f"target: {selection.target or NO_TARGET}", width=width,
                                  subsequent_indent="  ", break_on_hyphens=False)))
    print("\n".join(lines))
    if dropped:
        print("\n".join(textwrap.wrap(f"({', '.join(dropped)}: npu-inject show ID or npu-inject list --json)",
                                      width=width)))
    return EXIT_OK


def cmd_show(args) -> int:
    selection = selection_mod.make()
    spec = selection.registry.get(args.patch_id)
    problems = module_problems([spec])
    if problems:
        return _print_problems(problems)
    print(json.dumps({**spec.to_json(), "state": _state(selection, spec.id)}, indent=2))
    return EXIT_OK


def module_problems(specs: Iterable[registry_mod.PatchSpec]) -> list[str]:
    """One line per registry entry whose patch module is missing or unreadable, naming the registry file,
    the patch id and the module. Sources are found and parsed, never imported (as doctor reads them)."""
    problems = []
    for spec in specs:
        if module_source(spec.module) is None:
            problems.append(f"{spec.defined_in}: patch {spec.id!r}: module {spec.module!r} not found (no source file "
                            "on sys.path); 'module' must name the Python module holding the patch, importable "
                            "where the run starts")
            continue
        try:
            read_module_facts(spec.module)  # its docstring and TARGETS, read with ast
        except ConfigError as exc:
            problems.append(f"{spec.defined_in}: patch {spec.id!r}: module {spec.module!r}: {exc}")
    return problems


def _print_problems(problems: list[str]) -> int:
    for problem in problems:
        print(f"npu-inject: error: {problem}", file=sys.stderr)
    return EXIT_ERROR


def cmd_check(args) -> int:
    selection = selection_mod.make()
    problems = module_problems(selection.registry.patches.values())
    if problems:
        return _print_problems(problems)
    on = [patch_id for patch_id in selection.registry.patches if selection.state(patch_id) == "pending"]
    print(f"OK: target={selection.target or 'off'}, strict={int(selection.settings.strict)}, "
          f"registries: {', '.join(selection.registry.sources)}")
    print(f"enabled ({len(on)}): {', '.join(on) or '-'}")
    return EXIT_OK


# -- doctor ------------------------------------------------------------------

def _defined_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for element in ast.walk(target):
                    if isinstance(element, ast.Name):
                        names[element.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                names.update(_defined_names(block))
    return names


def target_status(target: str) -> str:
    """'ok', 'ok (inherited ...)', or why a 'module:qualname' target is missing from the sources.

    A method a class does not define itself may come from a base class in another
    package (torchtitan's RMSNorm takes forward from nn.RMSNorm): without importing,
    that is reported as inherited rather than missing.
    """
    module_name, qualname = split_target(target)
    if qualname == "*":
        return "ok (the patch serves the whole module)"
    path = module_source(module_name)
    if path is None:
        return f"module {module_name} not found"
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    body: list[ast.stmt] = tree.body
    owner: ast.AST | None = None
    for part in qualname.split("."):
        node = _defined_names(body).get(part)
        if node is None:
            if isinstance(owner, ast.ClassDef) and owner.bases:
                bases = ", ".join(ast.unparse(base) for base in owner.bases)
                return f"ok (inherited from {bases}; not checked without importing)"
            return f"{part!r} not defined in {path}"
        owner = node
        body = node.body if isinstance(node, ast.ClassDef) else []
    return "ok"


def cmd_doctor(args) -> int:
    selection = selection_mod.make()
    optional = (name for spec in selection.registry.patches.values() for name in spec.packages)
    versions = {dist: selection.versions[dist] if dist in selection.versions else selection_mod.installed_version(dist)
                for dist in dict.fromkeys((*DOCTOR_DISTRIBUTIONS, *optional))}
    print("installed:")
    for dist, version in versions.items():
        print(f"  {dist:14} {version or '-'}")
    problems = 0
    if selection.target == "npu":
        probe_ok, probe = _probe_torch_npu()
        problems += not probe_ok
        print(f"  torch_npu import: {probe if probe_ok else 'PROBLEM: ' + probe}")
    print(f"patches enabled for target {selection.target or 'off'}:")
    unchecked: dict[str, list[str]] = {}  # why -> the patches doctor did not check for it
    for spec in selection.registry.patches.values():
        state, reason = selection.initial[spec.id]
        if state == selection_mod.NOT_APPLICABLE:
            print(f"  {spec.id:18} not applicable: {reason}")
        if state != "pending":
            unchecked.setdefault(reason.removeprefix("off: ") if state == "disabled" else
                                 f"{', '.join(selection_mod.missing_packages(spec))} not installed", []).append(spec.id)
            continue
        issues = []
        version_issue = selection.version_problem(spec.id)
        if version_issue:
            issues.append(version_issue)
        notes = []
        try:
            targets = spec.targets
        except ConfigError as exc:  # the patch module cannot be read: that patch would fail to apply
            issues.append(str(exc))
            targets = ()
        for target in targets:
            status = target_status(target.name)
            package = split_target(target.name)[0].split(".")[0]
            if target.condition and status.startswith("module ") and importlib.util.find_spec(package) is None:
                # changed only under its condition, which cannot hold without the package (torchft)
                notes.append(f"target {target.name}: not checked, {package} is not installed (changed only "
                             f"{target.condition})")
            elif not status.startswith("ok"):
                issues.append(f"target {target.name}: {status}")
            elif status != "ok" and "serves" not in status:
                notes.append(f"target {target.name}: {status[len('ok ('):-1]}")
        problems += bool(issues)
        verdict = "ok" if not issues else "PROBLEM: " + "; ".join(issues)
        print(f"  {spec.id:18} {verdict}" + "".join(f" [note: {note}]" for note in notes))
    if unchecked:
        print("not checked (nothing this run would apply): " + "; ".join(
            f"{', '.join(ids)} ({why})" for why, ids in unchecked.items()))
    if problems:
        print(f"{problems} problem(s): a run with this environment would not apply every enabled patch")
    return EXIT_OK if problems == 0 else EXIT_ERROR


def _probe_torch_npu() -> tuple[bool, str]:
    # A subprocess: importing torch_npu loads CANN and must not leak into this CLI.
    import subprocess

    probe = subprocess.run(
        [sys.executable, "-c", "import torch_npu, torch; print(torch.npu.device_count())"],
        capture_output=True, text=True, env={**os.environ, settings_mod.ENV_TARGET: "0"},
    )
    if probe.returncode == 0:
        return True, f"ok, {probe.stdout.strip()} device(s)"
    last_line = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
    return False, (f"import torch_npu failed ({last_line}); TORCHTITAN_NPU=1 needs torch_npu with "
                   "Ascend's CANN, or rehearse with TORCHTITAN_NPU=cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npu-inject",
        description="Patches that let upstream torchtitan train on Ascend NPUs: "
        "what is in the catalog, what the environment selects, and whether it fits this install.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser(
        "list", help="table of patches and their state",
        description="Every patch of the catalog and the user registries: what this environment would do with it "
                    "(TORCHTITAN_NPU, TORCHTITAN_NPU_PATCHES), its default, triggers, supported versions and "
                    "description. The table fits the terminal's width; --json has every field in full.")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(run=cmd_list)
    show = commands.add_parser(
        "show", help="one patch in full",
        description="One patch's registry entry in full (module, triggers, targets, requirements, supported "
                    "versions, options, description) and its state in this environment, as JSON.")
    show.add_argument("patch_id")
    show.set_defaults(run=cmd_show)
    commands.add_parser(
        "check", help="validate environment and registries; exit 0 or 2",
        description="Validate the TORCHTITAN_NPU* variables and the registries (the catalog and "
                    "TORCHTITAN_NPU_REGISTRY's files) without importing torch or torchtitan: a patch selection or "
                    "registry entry a run would refuse, or a user patch whose module cannot be found, exits 2 with "
                    "one line naming it.").set_defaults(run=cmd_check)
    commands.add_parser(
        "doctor", help="installed versions; do the enabled patches fit them?",
        description="Print the installed versions of torch, torchtitan, torch_npu and the rest, and check each "
                    "patch this environment enables: supported versions, and every target it patches present in "
                    "the installed torchtitan's source (read, not imported). Exit 2 on a problem.",
    ).set_defaults(run=cmd_doctor)
    from npu_inject.commands import compare  # stdlib-only at import, like this module

    compare.add_parser(commands)
    from npu_inject.commands import audit  # stdlib only, like compare

    audit.add_parser(commands)
    from npu_inject.commands import flight_recorder  # stdlib only, like audit

    flight_recorder.add_parser(commands)
    from npu_inject.commands import selftest  # imports torch only when the command runs

    selftest.add_parser(commands)
    from npu_inject.commands import suite  # stdlib only; runs torchtitan in child processes

    suite.add_parser(commands)
    from npu_inject.commands import plan  # stdlib only; the planner runs in worker processes

    plan.add_parser(commands)
    from npu_inject.commands import calibrate  # imports torch only when the command runs

    calibrate.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        if argv[:1] == ["plan"]:
            # torchtitan's flags follow the planner's: argparse would take them for its own.
            from npu_inject.commands import plan

            ours, theirs = plan.split_argv(parser._subparsers._group_actions[0].choices["plan"], argv[1:])
            args = parser.parse_args(["plan", *ours])
            args.torchtitan = theirs
        else:
            args = parser.parse_args(argv)
        return args.run(args)
    except ConfigError as exc:
        print(f"npu-inject: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _entry() -> Any:
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`npu-inject list | head`): what it wanted was written. Python would report the
        # pipe again when it flushes stdout at exit, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)
