"""``npu-inject audit PATH``: print a simulated-NPU audit (audit_rank<N>.json) as tables.

The simulated NPU (verification/sim_npu, ``TORCHTITAN_NPU_SIM_AUDIT=1``) writes one file per
rank next to the runtime's report: ops a real NPU would run on the host, host syncs per
training step and call site, and stream-order findings. PATH is such a file or a
directory holding them. Standard library only: this runs where torch is not installed.
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


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "audit_rank*.json")))
        found = found or sorted(glob.glob(os.path.join(path, "npu_inject", "audit_rank*.json")))
        if not found:
            raise FileNotFoundError(f"{path}: no audit_rank<N>.json here or in {os.path.join(path, 'npu_inject')}")
        return found
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file or directory (expected audit_rank<N>.json or its folder)")
    return [path]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def render(document: dict, source: str) -> str:
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
        documents = []
        for path in paths:
            with open(path, encoding="utf-8") as handle:
                documents.append((path, json.load(handle)))
    except (OSError, json.JSONDecodeError) as error:
        print(f"npu-inject audit: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    for path, document in documents:
        print(render(document, path))
        print()
    problems = any(d.get("fallback_ops") or d.get("stream_findings") for _, d in documents)
    return EXIT_FINDINGS if problems else EXIT_OK


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "audit", help="print a simulated-NPU audit (host-fallback ops, host syncs, stream order)")
    parser.add_argument("path", help="audit_rank<N>.json, or the dump folder / its npu_inject folder")
    parser.set_defaults(run=cmd_audit)
