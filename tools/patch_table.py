"""The patch table and what each patch changes in docs/patches.md, and the entry-key table in docs/registry.md.

Rendered from their one source each: the catalog (registry.json: triggers, defaults, options,
requirements), each patch module's docstring's first line (the description) and TARGETS, and
registry.PatchSpec's fields (the registry's keys). How a patch works stays in its module's docstring,
which the table links to, and is not repeated in the docs.
``python tools/patch_table.py --write`` rewrites both blocks (``--check``: exit 1 when stale; no flag:
print); tests/unit/tools/test_patch_table.py fails when a document differs from its ``render``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root holds tools/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import doc_blocks  # noqa: E402

DOC = os.path.join(doc_blocks.REPO, "docs", "patches.md")
BEGIN, END = doc_blocks.markers("patch-table", "tools/patch_table.py")
REGISTRY_DOC = os.path.join(doc_blocks.REPO, "docs", "registry.md")
KEYS_BEGIN, KEYS_END = doc_blocks.markers("registry-keys", "tools/patch_table.py")


def module_link(module: str) -> str:
    """A patch module's source file, relative to docs/."""
    return "../" + module.replace(".", "/") + ".py"


def render() -> str:
    from npu_inject import module_facts, registry

    catalog = registry.load(entry_points=False)  # the packaged catalog only
    lines = ["| id (its module) | default | runs on | requires | options | what it does |",
             "|---|---|---|---|---|---|"]
    for spec in catalog.patches.values():
        options = ", ".join(f"`{name}={value!r}`" for name, value in spec.options.items()) or "-"
        requires = ", ".join(f"`{required}`" for required in spec.requires) or "-"
        lines.append(f"| [`{spec.id}`]({module_link(spec.module)}) | {'on' if spec.default else 'off'} | "
                     f"{', '.join(spec.runs_on)} | {requires} | {options} | "
                     f"{module_facts.read(spec.module).description} |")
    lines += ["", "## What each patch changes", "",
              "Each patch's targets, its module's `TARGETS`, in the order the patch changes them "
              "(`npu-inject doctor` checks that each exists in the installed torchtitan):", ""]
    for spec in catalog.patches.values():
        targets = [f"`{target.name}`" + (f" ({target.condition})" if target.condition else "")
                   for target in module_facts.read(spec.module).targets]
        lines.append(f"- `{spec.id}`: " + ", ".join(targets))
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
