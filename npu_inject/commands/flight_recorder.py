"""``npu-inject flight-recorder DIR``: which rank a hung job waits for, from torch_npu's HCCL flight recorder dumps.

torch_npu's ProcessGroupHCCL dumps one file per rank (``TORCH_HCCL_DEBUG_INFO_TEMP_FILE<rank>``; under
torchtitan with the ``collectives`` patch, ``<dump>/comm_traces/rank_<N>``) when a collective times out,
or on demand through ``TORCH_HCCL_DEBUG_INFO_PIPE_FILE``. torch's analyser
(``python -m torch.distributed.flight_recorder.fr_trace``) cannot read torch_npu 2.14.0's dumps: every
entry's ``profiling_name`` is empty (fr_trace expects ``<backend>:<op>``), and the ``<prefix><rank>_py_traceback``
text files beside them share the dumps' prefix. This reads them without either: per process group, it
lines up each rank's collectives by sequence number and reports

* the first collective some ranks of the group entered and others did not (the others are behind:
  hung, dead or busy elsewhere), with the entering ranks' state and Python stack;
* collectives whose ranks cannot have made the same call: issued from different functions (the
  innermost recorded frame), or with different dtypes, or different sizes where the stack shows no
  all-to-all, gather or scatter (whose sizes may differ by rank);
* collectives still in flight (``scheduled``/``started``) on every rank.

Exit 0: the ranks agree; 1: a divergence or mismatch (printed); 2: bad input. The dumps are pickles of
plain containers: they are loaded with an unpickler that refuses any class. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import pickle
import re
import sys

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_ERROR = 2
IN_FLIGHT = ("scheduled", "started")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a flight recorder dump holds plain containers only")


EXPECTED = "expected a pickled flight recorder dump (a dict with 'entries') from torch_npu's ProcessGroupHCCL"


def load(path: str) -> dict:
    """The dump at ``path``; ValueError naming the file and what was expected when it is not one."""
    with open(path, "rb") as handle:
        if not handle.read(1):
            raise ValueError(f"{path}: empty file; {EXPECTED}")
        handle.seek(0)
        try:
            document = _PlainUnpickler(handle).load()
        except (pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError, TypeError) as exc:
            # what a truncated or foreign file raises from the unpickler
            raise ValueError(f"{path}: not a pickle of plain containers ({type(exc).__name__}: {exc}); "
                             f"{EXPECTED}") from None
    if not isinstance(document, dict) or "entries" not in document:
        raise ValueError(f"{path}: not a flight recorder dump (no 'entries'); {EXPECTED}")
    return document


def dumps(folder: str, prefix: str | None) -> dict[int, tuple[str, dict]]:
    """rank -> (path, dump) for the files named <prefix><rank> (other files, e.g. *_py_traceback, skipped)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such directory (expected the folder of <prefix><rank> dumps)")
    pattern = re.compile(rf"^({re.escape(prefix) if prefix else '.*?'})(\d+)$")
    found: dict[int, tuple[str, dict]] = {}
    prefixes = set()
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        match = pattern.match(os.path.basename(path))
        if match and os.path.isfile(path):
            prefixes.add(match.group(1))
            found[int(match.group(2))] = (path, load(path))
    if not found:
        raise FileNotFoundError(f"{folder}: no dump named {prefix or '<prefix>'}<rank>")
    if len(prefixes) > 1:
        raise ValueError(f"{folder}: dumps with several prefixes {sorted(prefixes)}: pass --prefix")
    return found


_LIBRARY = re.compile(r"[/\\](torch|torch_npu)[/\\]")


def _stack(entry: dict, frames: int) -> str:
    """The innermost frame, then the innermost ``frames`` outside torch and torch_npu (the caller's code)."""
    recorded = entry.get("frames", [])
    if not recorded:
        return "(no stack recorded)"
    callers = [f for f in recorded[1:] if not _LIBRARY.search(str(f.get("filename", "")))][:frames]
    return " <- ".join(f"{f.get('name')} ({f.get('filename')}:{f.get('line')})" for f in [recorded[0], *callers])


def _describe(entry: dict) -> str:
    return (f"{entry.get('state')}, input sizes {entry.get('input_sizes')}, dtypes {entry.get('input_dtypes')}, "
            f"output sizes {entry.get('output_sizes')}")


# Collectives whose ranks may pass different sizes (uneven all-to-all, a root's gather/scatter lists),
# recognised by a frame of the recorded stack: the entries carry no operation name.
_UNEVEN = re.compile(r"all_to_all|alltoall|(?<!all_)gather|(?<!reduce_)scatter")


def _disagreement(entries: dict[int, dict]) -> str | None:
    """Why the ranks' entries for one collective cannot be the same call, or None."""
    innermost = {e["frames"][0].get("name") for e in entries.values() if e.get("frames")}
    if len(innermost) > 1:
        return f"issued by different functions {sorted(map(str, innermost))}"
    if len({str(e.get("input_dtypes")) for e in entries.values()}) > 1:
        return "dtypes differ"
    uneven = any(_UNEVEN.search(str(f.get("name"))) for e in entries.values() for f in e.get("frames", []))
    if not uneven and len({str(e.get("input_sizes")) for e in entries.values()}) > 1:
        return "sizes differ"
    return None


def analyse(found: dict[int, tuple[str, dict]], frames: int = 6) -> tuple[list[str], bool]:
    """The report's lines and whether it found a divergence or a mismatch."""
    lines, findings = [], False
    groups: dict[str, dict] = {}
    for rank, (_, dump) in sorted(found.items()):
        for name, config in dump.get("pg_config", {}).items():
            groups.setdefault(name, config)
    for name, config in sorted(groups.items()):
        try:
            members = [int(r) for r in ast.literal_eval(str(config.get("ranks", "[]")))]
        except (ValueError, SyntaxError):
            members = []
        present = [r for r in members if r in found] or sorted(found)
        missing = [r for r in members if r not in found]
        # rank -> collective sequence number -> entry (p2p entries have their own numbering; left out)
        by_rank = {rank: {e["collective_seq_id"]: e for e in found[rank][1]["entries"]
                          if e.get("process_group", (None,))[0] == name and not e.get("is_p2p")}
                   for rank in present}
        last = {rank: max(entries, default=0) for rank, entries in by_rank.items()}
        desc = f" ({config.get('desc')})" if config.get("desc") else ""
        lines.append(f"group {name}{desc}: ranks {members or present}"
                     + (f"; no dump from ranks {missing}" if missing else ""))
        lines.append("  " + ", ".join(f"rank {rank} last collective #{last[rank]}" for rank in present))
        newest = max(last.values(), default=0)
        behind = [rank for rank in present if last[rank] < newest]
        group_findings = bool(behind)
        if behind:
            first = min(last[rank] for rank in behind) + 1
            ahead = [rank for rank in present if first in by_rank[rank]]
            lines.append(f"  DIVERGED at collective #{first}: entered by ranks {ahead}, not by ranks {behind} "
                         f"(their last: {', '.join(f'#{last[r]}' for r in behind)}); the ranks {behind} are "
                         "the ones to look at (hung, dead, or in another collective)")
            for rank in ahead:
                entry = by_rank[rank][first]
                lines.append(f"    rank {rank}: {_describe(entry)}")
                lines.append(f"      stack: {_stack(entry, frames)}")
        common = sorted(set.intersection(*(set(e) for e in by_rank.values()))) if by_rank else []
        for seq in common:
            entries = {rank: by_rank[rank][seq] for rank in present}
            problem = _disagreement(entries)
            if problem:
                group_findings = True
                lines.append(f"  MISMATCH at collective #{seq} ({problem}): "
                             + "; ".join(f"rank {rank} {_describe(e)}" for rank, e in entries.items()))
        in_flight = [seq for seq in common if all(by_rank[r][seq].get("state") in IN_FLIGHT for r in present)]
        if in_flight:
            lines.append(f"  in flight on every rank: {', '.join(f'#{s}' for s in in_flight)}")
        if not group_findings:
            lines.append("  the ranks agree")
        findings = findings or group_findings
    return lines, findings


def cmd_flight_recorder(args: argparse.Namespace) -> int:
    try:
        found = dumps(args.folder, args.prefix)
    except (OSError, ValueError) as error:
        print(f"npu-inject flight-recorder: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    versions = sorted({str(dump.get("version")) for _, dump in found.values()})
    print(f"{len(found)} dumps (ranks {sorted(found)}) in {args.folder}; format version {', '.join(versions)}")
    lines, findings = analyse(found, args.frames)
    print("\n".join(lines))
    return EXIT_FINDINGS if findings else EXIT_OK


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "flight-recorder",
        help="which rank a hung job waits for, from torch_npu's HCCL flight recorder dumps (torch's fr_trace "
             "cannot read torch_npu 2.14.0's)",
        description="Read torch_npu's HCCL flight recorder dumps (one file per rank, <prefix><rank>; under "
                    "torchtitan <dump>/comm_traces/rank_<N>) and name, per process group, the first collective some "
                    "ranks entered and others did not, collectives the ranks cannot have called alike, and those "
                    "in flight on every rank. Exit 0: the ranks agree; 1: a divergence or mismatch; 2: bad input.")
    parser.add_argument("folder", help="the folder of the dumps, e.g. <dump>/comm_traces")
    parser.add_argument("--prefix", default=None,
                        help="the dumps' file name before the rank (default: inferred, e.g. rank_)")
    parser.add_argument("--frames", type=int, default=6, help="Python frames to show per entry (default 6)")
    parser.set_defaults(run=cmd_flight_recorder)
