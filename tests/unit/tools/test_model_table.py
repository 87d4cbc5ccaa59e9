"""docs/models.md's model table is what tools/model_table.py renders from the matrix's rows."""

from __future__ import annotations

import importlib.util

import os

from testkit import REPO  # first: puts the repository root on sys.path for tools/
from tools import doc_blocks, model_table


def test_docs_hold_the_rendered_table():
    assert model_table.DOC == os.path.join(REPO, "docs", "models.md")
    with open(model_table.DOC, encoding="utf-8") as handle:
        assert doc_blocks.block(handle.read(), model_table.BEGIN, model_table.END) == model_table.render(), (
            "docs/models.md's model table is stale: python tools/model_table.py --write")


def test_every_torchtitan_model_family_has_a_row():
    import torchtitan.models

    families = {name for name in torchtitan.models._supported_models
                if importlib.util.find_spec(f"torchtitan.models.{name}") is not None}
    assert families <= {row.module for row in model_table.ROWS}, families


def test_rows_are_unique_and_stopping_rows_say_what_they_expect():
    configs = [(row.module, row.config) for row in model_table.ROWS]
    assert len(configs) == len(set(configs))
    for row in model_table.ROWS:
        assert row.trains or row.stop, row
        assert set(row.ci) <= set(model_table.TARGETS), row
        # CI trains every training row on a target at least (one case per dimension): in the matrix, or in the
        # tests it names; every target trains some row.
        assert not row.trains or set(row.ci) | set(dict(row.ci_elsewhere)), row
        assert not set(row.ci) & set(dict(row.ci_elsewhere)), row  # a target is trained once in CI
    assert {target for row in model_table.ROWS if row.trains
            for target in (*row.ci, *dict(row.ci_elsewhere))} == set(model_table.TARGETS)
