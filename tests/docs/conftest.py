"""Every test here runs a command block of README.md or docs/*.md (tools/doc_commands.py): marked docs here, and
left out of the default selection and of CI but for the one case tests/docs/test_doc_blocks.py also marks e2e."""

from __future__ import annotations

import pytest

FOLDER_MARKER = "docs"  # tests/conftest.py: a run naming only files here runs them without -m


def pytest_itemcollected(item):  # called for the items under this folder only
    item.add_marker(getattr(pytest.mark, FOLDER_MARKER))
