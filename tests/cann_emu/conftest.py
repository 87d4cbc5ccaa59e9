"""Every test here runs the real torch_npu 2.14.0 wheel on the CANN emulation: marked cann_emu, and
skipped, saying why, when the emulation's venv or its built libraries are absent
(tests/support/cann_emu_child.py; ``bash verification/cann_emu/setup.sh`` makes both)."""

from __future__ import annotations

import pytest

from cann_emu_child import missing

FOLDER_MARKER = "cann_emu"  # tests/conftest.py: a run naming only files here runs them without -m


def pytest_itemcollected(item):  # called for the items under this folder only
    item.add_marker(getattr(pytest.mark, FOLDER_MARKER))
    reason = missing()
    if reason:
        item.add_marker(pytest.mark.skip(reason=reason))
