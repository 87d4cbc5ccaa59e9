"""``npu-inject audit PATH``: print an audit of what a run asks of the NPU, as tables.

Two sources, one file per rank next to the runtime's report (``<dump>/npu_inject/``):

* ``audit_rank<N>.json``, the simulated NPU's (verification/sim_npu, ``TORCHTITAN_NPU_SIM_AUDIT=1``):
  ops a real NPU would run on the host, host syncs per training step and call site, stream-order
  findings.
* ``cann_emu_rank<N>.json``, the CANN emulation's (verification/cann_emu, ``CANN_EMU_COUNTS``): what
  the real torch_npu asked of CANN per training step: aclnn operators, those CANN runs on AI CPU,
  operators sent down the legacy aclop path, host synchronisations by call, HCCL calls; the collectives
  apart: standalone, and those MC2 operators (collective + GEMM in one) made themselves, with the bytes;
  each host synchronisation by the Python line that made it and its owner; the aclnn launches of the last
  step by model scope (a block's forward or backward, the embedding, the loss, the optimizer).

PATH is such a file or a directory holding them. AI CPU and aclop operators, host-fallback ops and
stream-order findings are findings (exit 1). Standard library only: this runs where torch is not
installed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_ERROR = 2


PATTERNS = ("audit_rank*.json", "cann_emu_rank*.json")


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        for folder in (path, os.path.join(path, "npu_inject")):
            found = sorted(f for pattern in PATTERNS for f in glob.glob(os.path.join(folder, pattern)))
            if found:
                return found
        raise FileNotFoundError(f"{path}: no audit_rank<N>.json or cann_emu_rank<N>.json here or in "
                                f"{os.path.join(path, 'npu_inject')}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file or directory (expected audit_rank<N>.json or its folder)")
    return [path]


EXPECTED = ("expected a JSON object written by the simulated NPU (audit_rank<N>.json, schema 1) or the CANN "
            "emulation (cann_emu_rank<N>.json, schema 2 with 'soc')")


def read_document(path: str) -> dict:
    """The audit file at ``path``; ValueError naming the file and what was expected when it is not one."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if not text.strip():
        raise ValueError(f"{path}: empty file; {EXPECTED}")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg}); {EXPECTED}") from None
    if not isinstance(document, dict) or document.get("schema") not in (1, 2) or (
            document.get("schema") == 2 and "soc" not in document):
        found = f"keys {sorted(document)[:8]}" if isinstance(document, dict) else f"a JSON {type(document).__name__}"
        raise ValueError(f"{path}: not an audit file ({found}); {EXPECTED}")
    return document


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _is_cann_emu(document: dict) -> bool:
    return document.get("schema") == 2 and "soc" in document


def _step_key(name: str) -> tuple[int, int]:
    return (1, 0) if not name.isdigit() else (0, int(name))


def _counted(counter: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counter.items())) or "0"


# HCCL's collective and point-to-point calls (the rest: configuration, communicators, queries).
COLLECTIVES = ("HcclAllReduce", "HcclReduce", "HcclBroadcast", "HcclScatter", "HcclAllGather", "HcclAllGatherV",
               "HcclReduceScatter", "HcclReduceScatterV", "HcclAlltoAll", "HcclAlltoAllV", "HcclBarrier", "HcclSend",
               "HcclRecv", "HcclBatchSendRecv")


def collectives(step_counts: dict) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """(standalone, inside MC2 operators): ``{call: (calls, bytes)}`` of one step's HCCL counts. A call an MC2
    operator made itself is counted as ``<operator>:<call>``; bytes are the calling rank's input."""
    standalone, fused = {}, {}
    moved = step_counts.get("hccl_bytes", {})
    for key, calls in step_counts.get("hccl", {}).items():
        operator, _, call = key.rpartition(":")
        if call in COLLECTIVES:
            (fused if operator else standalone)[key] = (calls, moved.get(key, 0))
    return standalone, fused


def _mib(count_and_bytes: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{name} {calls} ({moved / 2**20:.2f} MiB)" for name, (calls, moved) in
                     sorted(count_and_bytes.items())) or "0"


OWNERS = ("npu_inject", "torchtitan", "other", "torch/torch_npu", "torch_npu", "none")


def _site_parts(key: str, count: int) -> list[str]:
    """The emulation's " | "-joined site key as ``count`` fields (missing trailing ones empty)."""
    return [part.strip() for part in (key.split(" | ") + [""] * count)[:count]]


def sync_sites(step_counts: dict) -> list[tuple[str, str, str, str, int]]:
    """(kind, owner, caller, via, count) per host synchronisation site of one step, most frequent first. The
    caller is the first Python frame outside torch, torch_npu, wrapt and the standard library; its package
    owns the sync (npu_inject, torchtitan, other; torch/torch_npu when there is none)."""
    rows = []
    for key, count in step_counts.get("sync_sites", {}).items():
        kind, owner, caller, via = _site_parts(key, 4)
        rows.append((kind, owner, caller, via, count))
    return sorted(rows, key=lambda row: (-row[4], OWNERS.index(row[1]) if row[1] in OWNERS else 99, row[2]))


def _render_sync_sites(document: dict) -> list[str]:
    steps = [step for step in sorted(document.get("steps", {}), key=_step_key) if step.isdigit()]
    if not steps or not any(document["steps"][step].get("sync_sites") for step in steps):
        return []
    out = ["", "Host synchronisations per step by owner (the first Python frame outside torch/torch_npu):"]
    for step in steps:
        owners: dict[str, int] = {}
        for _, owner, _, _, count in sync_sites(document["steps"][step]):
            owners[owner] = owners.get(owner, 0) + count
        out.append(f"  step {step}: " + (", ".join(f"{owner} {n}" for owner, n in sorted(owners.items())) or "0"))
    last = steps[-1]
    out += ["", f"Host synchronisations of step {last} by source line:"]
    rows = [[count, kind, owner, caller, via] for kind, owner, caller, via, count in sync_sites(document["steps"][last])]
    out.append(_table(["count", "sync", "owner", "caller", "innermost torch frame"], rows))
    return out


def scope_launches(step_counts: dict) -> list[tuple[str, int, dict[str, int]]]:
    """(scope, launches, {operator: launches}) of one step in program order: the model scopes the emulation's
    step marks name (a child's forward and backward, the loss, gradient clipping, the optimizer, ...)."""
    per_scope: dict[str, dict[str, int]] = {}
    for key, count in step_counts.get("scope_ops", {}).items():
        scope, _, operator = key.rpartition(" | ")
        per_scope.setdefault(scope, {})[operator] = count
    order = step_counts.get("scope_order", {})
    return [(scope, sum(ops.values()), ops)
            for scope, ops in sorted(per_scope.items(), key=lambda item: (order.get(item[0], 1 << 62), item[0]))]


def _render_scopes(document: dict) -> list[str]:
    steps = [step for step in sorted(document.get("steps", {}), key=_step_key) if step.isdigit()]
    if not steps or not document["steps"][steps[-1]].get("scope_ops"):
        return []
    last = steps[-1]
    rows = [[scope, launches, ", ".join(f"{name.removeprefix('aclnn')} {n}" for name, n in
                                        sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
             + (f", +{len(ops) - 5} more" if len(ops) > 5 else "")]
            for scope, launches, ops in scope_launches(document["steps"][last])]
    return ["", f"aclnn launches of step {last} by model scope (what was dispatched from the mark on; "
                "the five most launched operators):",
            _table(["scope", "launches", "operators"], rows)]


def launch_sites(step_counts: dict) -> list[tuple[str, str, str, str, str, int]]:
    """(scope, operator, owner, caller, via, count) per launch site of one step (CANN_EMU_LAUNCH_SITES's
    operators), most frequent first: who prepared each launch, read as a synchronisation's site."""
    rows = []
    for key, count in step_counts.get("launch_sites", {}).items():
        scope, operator, owner, caller, via = _site_parts(key, 5)
        rows.append((scope, operator, owner, caller, via, count))
    return sorted(rows, key=lambda row: (-row[5], row[0], row[1], row[3]))


def _render_launch_sites(document: dict) -> list[str]:
    steps = [step for step in sorted(document.get("steps", {}), key=_step_key) if step.isdigit()]
    if not steps or not document["steps"][steps[-1]].get("launch_sites"):
        return []
    last = steps[-1]
    rows = [[count, scope, operator.removeprefix("aclnn"), owner, caller, via]
            for scope, operator, owner, caller, via, count in launch_sites(document["steps"][last])]
    return ["", f"Launches of step {last} by source line (the operators CANN_EMU_LAUNCH_SITES names):",
            _table(["count", "scope", "operator", "owner", "caller", "innermost torch frame"], rows)]


def render_cann_emu(document: dict, source: str) -> str:
    """The real torch_npu's calls into the CANN emulation, one row per training step."""
    out = [f"{source} (rank {document.get('rank')}, {document.get('soc')}; the real torch_npu's calls into "
           "the CANN emulation)", ""]
    rows = []
    for step in sorted(document.get("steps", {}), key=_step_key):
        counts = document["steps"][step]
        rows.append([step, f"{sum(counts['aclnn'].values())} ({len(counts['aclnn'])})",
                     _counted(counts["aicpu"]), _counted(counts["aclop"]), _counted(counts["syncs"]),
                     _counted(counts["hccl"])])
    out.append(_table(["step", "aclnn calls (operators)", "AI CPU", "legacy aclop", "host syncs", "HCCL"], rows))
    out.append("")
    rows = [[step, _mib(standalone), _mib(fused)] for step in sorted(document.get("steps", {}), key=_step_key)
            for standalone, fused in [collectives(document["steps"][step])]]
    out.append("Collectives per step, calls (MiB this rank put in): standalone, and inside MC2 operators "
               "(collective + GEMM in one operator)")
    out.append(_table(["step", "standalone collectives", "inside MC2 operators"], rows))
    out += _render_sync_sites(document)
    out += _render_scopes(document)
    out += _render_launch_sites(document)
    for key, title in (("aicpu", "Operators CANN runs on AI CPU"), ("aclop", "Operators sent down the legacy aclop path")):
        out.append(f"{title}: {_counted(document.get(key, {}))}")
    return "\n".join(out)


def render(document: dict, source: str) -> str:
    if _is_cann_emu(document):
        return render_cann_emu(document, source)
    out = [f"{source} (rank {document.get('rank')}, steps {document.get('steps')})", ""]
    fallbacks = document.get("fallback_ops", {})
    out.append(f"Host-fallback ops (no NPU kernel in torch_npu): {len(fallbacks)}")
    if fallbacks:
        rows = [[name, record["count"], ", ".join(f"{k}={v}" for k, v in record["phases"].items()),
                 ", ".join(record["sites"])] for name, record in fallbacks.items()]
        out.append(_table(["op", "count", "phases", "sites"], rows))
    out.append("")
    syncs = document.get("syncs", {})
    rows = [[step, row["kind"], row["op"], row["count"], row["site"]]
            for step, step_rows in syncs.items() for row in step_rows]
    out.append(f"Host syncs: {sum(row[3] for row in rows)}")
    if rows:
        out.append(_table(["step", "kind", "op", "count", "site"], rows))
    out.append("")
    findings = document.get("stream_findings", [])
    out.append(f"Stream-order findings: {len(findings)}")
    out += [f"  [{f['count']}x] {f['finding']}" for f in findings]
    return "\n".join(out)


def cmd_audit(args: argparse.Namespace) -> int:
    try:
        paths = _files(args.path)
        documents = [(path, read_document(path)) for path in paths]
    except (OSError, ValueError) as error:
        print(f"npu-inject audit: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    for path, document in documents:
        print(render(document, path))
        print()
    problems = any(d.get("fallback_ops") or d.get("stream_findings") or d.get("aicpu") or d.get("aclop")
                   for _, d in documents)
    return EXIT_FINDINGS if problems else EXIT_OK


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "audit", help="print a run's NPU audit: the simulated NPU's (host-fallback ops, host syncs, stream order) "
                      "or the CANN emulation's (aclnn, AI CPU and aclop operators, host syncs, HCCL per step)",
        description="Print what a run asked of the NPU, as tables: the simulated NPU's audit_rank<N>.json "
                    "(TORCHTITAN_NPU_SIM_AUDIT=1: host-fallback ops, host syncs per step, stream-order findings) or the "
                    "CANN emulation's cann_emu_rank<N>.json (CANN_EMU_COUNTS: aclnn, AI CPU and aclop operators, host "
                    "syncs, HCCL calls per step). Exit 0: clean; 1: findings (host-fallback ops, stream-order "
                    "findings, AI CPU or aclop operators); 2: bad input.")
    parser.add_argument("path", help="audit_rank<N>.json or cann_emu_rank<N>.json, or the dump folder / its "
                                     "npu_inject folder")
    parser.set_defaults(run=cmd_audit)
