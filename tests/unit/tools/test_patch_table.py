"""docs/patches.md and docs/registry.md hold what tools/patch_table.py renders from the catalog,
the patch modules' descriptions and TARGETS, and registry.PatchSpec's fields."""

from __future__ import annotations

import os

from testkit import REPO  # first: puts the repository root on sys.path for tools/
from tools import doc_blocks, patch_table

from npu_inject import module_facts, registry


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def test_docs_hold_the_rendered_blocks():
    assert patch_table.DOC == os.path.join(REPO, "docs", "patches.md")
    assert doc_blocks.block(_read(patch_table.DOC), patch_table.BEGIN, patch_table.END) == patch_table.render(), (
        "docs/patches.md is stale: python tools/patch_table.py --write")
    assert doc_blocks.block(_read(patch_table.REGISTRY_DOC), patch_table.KEYS_BEGIN,
                            patch_table.KEYS_END) == patch_table.render_keys(), (
        "docs/registry.md's key table is stale: python tools/patch_table.py --write")


def test_one_row_and_one_targets_line_per_patch_from_its_module():
    catalog = registry.load(None, entry_points=False)
    rendered = patch_table.render()
    rows = [line for line in rendered.splitlines() if line.startswith("| [`")]
    assert [row.split("`")[1] for row in rows] == list(catalog.patches)
    targets_lines = [line for line in rendered.splitlines() if line.startswith("- `")]
    assert [line.split("`")[1] for line in targets_lines] == list(catalog.patches)
    for row, targets_line, spec in zip(rows, targets_lines, catalog.patches.values()):
        facts = module_facts.read(spec.module)
        assert row.rstrip(" |").endswith(facts.description)
        # the id links to the module's source, where the docstring says how the patch works
        link = row.split("](", 1)[1].split(")", 1)[0]
        assert os.path.samefile(os.path.join(REPO, "docs", link), facts.path)
        assert all(f"`{target.name}`" in targets_line for target in facts.targets)


def test_the_page_does_not_repeat_the_modules_docstrings():
    """How a patch works is written once, in its module; the page links to it."""
    page = _read(patch_table.DOC)
    for spec in registry.load(None, entry_points=False).patches.values():
        details = module_facts.read(spec.module).details
        assert details.split("\n\n")[0] not in page, spec.id


def test_a_changed_docstring_makes_the_block_stale(monkeypatch):
    """The drift check can fail: the rendered block follows the modules, not the document."""
    real_read = module_facts.read

    def read_with_new_docstring(module_name):
        facts = real_read(module_name)
        if module_name.endswith(".device"):
            return module_facts.ModuleFacts(facts.path, "changed\n\nchanged too", facts.targets)
        return facts

    monkeypatch.setattr(module_facts, "read", read_with_new_docstring)
    assert doc_blocks.block(_read(patch_table.DOC), patch_table.BEGIN, patch_table.END) != patch_table.render()


def test_every_registry_key_is_in_the_key_table():
    table = patch_table.render_keys()
    assert [line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")] == list(
        registry.ENTRY_KEYS)
