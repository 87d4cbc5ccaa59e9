"""Every test here is a multi-process end-to-end run, marked e2e here, except the parallelism matrix's
cases (marker parallel): tests/e2e/test_parallel_matrix.py marks e2e the ones CI runs, which CI's
selection (``e2e or not parallel``, tools/test.sh) picks by that marker."""

from __future__ import annotations

import pytest

FOLDER_MARKER = "e2e"  # tests/conftest.py: a run naming only files here runs them without -m


def pytest_itemcollected(item):  # called for the items under this folder only
    if item.get_closest_marker("parallel") is None:
        item.add_marker(getattr(pytest.mark, FOLDER_MARKER))
