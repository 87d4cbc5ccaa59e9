"""The patch table and "how each patch works" in docs/patches.md, and the entry-key table in docs/registry.md.

Rendered from their one source each: the catalog (registry.json: triggers, defaults, options,
requirements), each patch module's docstring (first line: the description; the rest: how it
works) and TARGETS, and registry.PatchSpec's fields (the registry's keys).
``python tools/patch_table.py --write`` rewrites both blocks (``--check``: exit 1 when stale; no flag:
print); tests/unit/tools/test_patch_table.py fails when a document differs from its ``render``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

if __package__ in (None, ""):  # run as a script: the repository root holds tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import doc_blocks  # noqa: E402

DOC = os.path.join(doc_blocks.REPO, "docs", "patches.md")
BEGIN, END = doc_blocks.markers("patch-table", "tools/patch_table.py")
REGISTRY_DOC = os.path.join(doc_blocks.REPO, "docs", "registry.md")
KEYS_BEGIN, KEYS_END = doc_blocks.markers("registry-keys", "tools/patch_table.py")
# Sphinx roles in docstrings (:class:`~a.b.C`, :func:`a.b`) as plain code spans.
_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data):`(~?)([^`]+)`")


def _markdown(docstring_text: str) -> str:
    return _ROLE.sub(lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", docstring_text)


def render() -> str:
    from npu_inject import module_facts, registry

    catalog = registry.load(entry_points=False)  # the packaged catalog only
    lines = ["| id | default | runs on | requires | options | what it does |", "|---|---|---|---|---|---|"]
    for spec in catalog.patches.values():
        options = ", ".join(f"`{name}={value!r}`" for name, value in spec.options.items()) or "-"
        requires = ", ".join(f"`{required}`" for required in spec.requires) or "-"
        lines.append(f"| `{spec.id}` | {'on' if spec.default else 'off'} | {', '.join(spec.runs_on)} | "
                     f"{requires} | {options} | {spec.description} |")
    lines += ["", "## How each patch works", "",
              "Each section is the patch module's docstring, and its targets are the module's `TARGETS`, "
              "in the order the patch changes them."]
    for spec in catalog.patches.values():
        facts = module_facts.read(spec.module)
        targets = [f"`{target.name}`" + (f" ({target.condition})" if target.condition else "")
                   for target in facts.targets]
        lines += ["", f"### `{spec.id}`", "", f"**{spec.description}**", "", _markdown(facts.details), "",
                  "Targets: " + ", ".join(targets) + "."]
    return "\n".join([BEGIN, *lines, END])


def render_keys() -> str:
    from npu_inject import registry

    lines = ["| key | default | a user registry may change it | meaning |", "|---|---|---|---|"]
    for name, key in registry.ENTRY_KEYS.items():
        default = registry.key_default(name)
        if default is dataclasses.MISSING:
            shown = "(required)"
        elif name == "module":
            shown = f"`{registry.PATCH_PACKAGE}.<id>`"
        else:
            shown = f"`{registry._jsonable(default)!r}`".replace("'", '"').replace("True", "true")
        overridable = "yes" if key.metadata["overridable"] else "no"
        lines.append(f"| `{name}` | {shown} | {overridable} | {key.metadata['meaning']} |")
    return "\n".join([KEYS_BEGIN, *lines, KEYS_END])


if __name__ == "__main__":
    sys.exit(doc_blocks.main_blocks([(render, DOC, BEGIN, END), (render_keys, REGISTRY_DOC, KEYS_BEGIN, KEYS_END)],
                                    __doc__.splitlines()[0]))
