"""Generated blocks in the docs: text between ``<!-- NAME:begin (tool) -->`` and ``<!-- NAME:end -->``.

One helper for every table a tool renders from the code's own data (the model table, the patch
table): the tool gives ``render()``; tests compare the document's block with it, and the tool's
``--write`` replaces the block.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def markers(name: str, tool: str) -> tuple[str, str]:
    return f"<!-- {name}:begin ({tool}) -->", f"<!-- {name}:end -->"


def block(text: str, begin: str, end: str) -> str | None:
    """The block in ``text``, markers included; None when the markers are absent."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < 0:
        return None
    return text[start:stop + len(end)]


def main(render: Callable[[], str], path: str, begin: str, end: str, description: str) -> int:
    """Print the block, or with --check/--write compare it with / write it into ``path``."""
    return main_blocks([(render, path, begin, end)], description)


def main_blocks(blocks: list[tuple[Callable[[], str], str, str, str]], description: str) -> int:
    """:func:`main` for several blocks (render, path, begin, end), each in its own document or not."""
    paths = sorted({os.path.relpath(path, REPO) for _, path, _, _ in blocks})
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {', '.join(paths)} differ")
    parser.add_argument("--write", action="store_true", help=f"replace the blocks in {', '.join(paths)}")
    args = parser.parse_args()
    status = 0
    for render, path, begin, end in blocks:
        rendered = render()
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        current = block(text, begin, end)
        if args.write:
            if current is None:
                print(f"{path} has no {begin} ... {end} block to replace", file=sys.stderr)
                return 1
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text.replace(current, rendered))
        elif args.check:
            if current != rendered:
                print(f"{path}: the generated block differs; run: python {sys.argv[0]} --write", file=sys.stderr)
                status = 1
        else:
            print(rendered)
    return status
