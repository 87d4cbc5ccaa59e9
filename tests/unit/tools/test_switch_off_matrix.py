"""tools/switch_off_matrix.py: which patches it switches off, and its table (the runs themselves are the
emulation's, recorded in docs/suite/switch_off_cann_emu.json)."""

from __future__ import annotations

import json
import os

from testkit import REPO  # first: puts the repository root on sys.path for tools/
from tools import switch_off_matrix


def test_every_default_on_npu_patch_and_no_other():
    patches = switch_off_matrix.default_on_patches()
    assert "rotary" in patches and "positions_check" in patches
    assert "swap_optimizer" not in patches  # off by default
    assert "rehearsal_dtype" not in patches  # runs on the CPU rehearsal only


def test_the_recorded_rows_name_known_patches_and_every_non_green_row_says_why():
    rows = json.load(open(os.path.join(REPO, "docs", "suite", "switch_off_cann_emu.json"), encoding="utf-8"))
    known = set(switch_off_matrix.default_on_patches())
    assert {row["patch"] for row in rows} == known  # the llama3 column is whole
    assert all(row["cause"] for row in rows if row["status"] != "green")
    table = switch_off_matrix.markdown(rows, ["llama3", "deepseek_v3"])
    assert table.splitlines()[0] == "| patch off | llama3 | deepseek_v3 |"
    assert "not run" in table  # deepseek_v3 ran for a subset
