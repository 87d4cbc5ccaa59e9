"""docs/patches.md's patch table is what tools/patch_table.py renders from registry.json."""

from __future__ import annotations

import json
import os

from testkit import REPO  # first: puts the repository root on sys.path for tools/
from tools import doc_blocks, patch_table


def _doc() -> str:
    with open(patch_table.DOC, encoding="utf-8") as handle:
        return handle.read()


def test_docs_hold_the_rendered_table():
    assert patch_table.DOC == os.path.join(REPO, "docs", "patches.md")
    assert doc_blocks.block(_doc(), patch_table.BEGIN, patch_table.END) == patch_table.render(), (
        "docs/patches.md's patch table is stale: python tools/patch_table.py --write")


def test_table_has_one_row_per_catalog_entry_with_its_description():
    with open(os.path.join(REPO, "npu_inject", "registry.json"), encoding="utf-8") as handle:
        catalog = json.load(handle)["patches"]
    rows = [line for line in patch_table.render().splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip().strip("`") for row in rows] == list(catalog)
    for row, entry in zip(rows, catalog.values()):
        assert row.rstrip(" |").endswith(entry["description"])


def test_a_changed_description_makes_the_block_stale(monkeypatch):
    """The drift check can fail: the rendered block follows the catalog, not the document."""
    from npu_inject import registry

    real_load = registry.load

    def load_with_new_description(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        spec = loaded.patches["device"]
        loaded.patches["device"] = type(spec)(**{**spec.__dict__, "description": "changed"})
        return loaded

    monkeypatch.setattr(registry, "load", load_with_new_description)
    assert doc_blocks.block(_doc(), patch_table.BEGIN, patch_table.END) != patch_table.render()


def test_every_patch_is_explained_in_prose():
    with open(os.path.join(REPO, "npu_inject", "registry.json"), encoding="utf-8") as handle:
        catalog = json.load(handle)["patches"]
    explained = {line[2:].split(":", 1)[0] for line in _doc().splitlines() if line.startswith("- `")}
    assert {f"`{patch_id}`" for patch_id in catalog} <= explained, "docs/patches.md 'How each patch works'"
