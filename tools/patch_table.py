"""The patch table in docs/patches.md, rendered from registry.json (the catalog is its one source).

``python tools/patch_table.py --write`` rewrites it (``--check``: exit 1 when stale; no flag: print);
tests/unit/tools/test_patch_table.py fails when the document differs from ``render()``.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root holds tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import doc_blocks  # noqa: E402

DOC = os.path.join(doc_blocks.REPO, "docs", "patches.md")
BEGIN, END = doc_blocks.markers("patch-table", "tools/patch_table.py")


def render() -> str:
    from npu_inject import registry

    catalog = registry.load(entry_points=False)  # the packaged catalog only
    lines = ["| id | default | runs on | requires | options | what it does |", "|---|---|---|---|---|---|"]
    for spec in catalog.patches.values():
        options = ", ".join(f"`{name}={value!r}`" for name, value in spec.options.items()) or "-"
        requires = ", ".join(f"`{required}`" for required in spec.requires) or "-"
        lines.append(f"| `{spec.id}` | {'on' if spec.default else 'off'} | {', '.join(spec.runs_on)} | "
                     f"{requires} | {options} | {spec.description} |")
    return "\n".join([BEGIN, *lines, END])


if __name__ == "__main__":
    sys.exit(doc_blocks.main(render, DOC, BEGIN, END, __doc__.splitlines()[0]))
