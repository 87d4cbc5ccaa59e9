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


def test_a_run_is_green_stopped_in_one_line_or_red():
    assert switch_off_matrix.classify(0, "step:  2  loss:  7.9", True) == ("green", "", "")
    runtime_stop = "npu_inject.errors.ConfigError: npu_inject (patch parallel_checks): FlexAttention ...\n"
    assert switch_off_matrix.classify(1, runtime_stop, False)[0] == "stopped"
    # torchtitan's own check at start-up (cuda_graphs off with expert parallelism) is one line too
    upstream_stop = "│ Error parsing Config: CUDA graphs support only expert parallel token │\n"
    status, cause, who = switch_off_matrix.classify(1, upstream_stop, False)
    assert (status, who) == ("stopped", "torchtitan (its own config check, at start-up)") and "CUDA graphs" in cause
    assert switch_off_matrix.classify(1, "step:  1  loss:  8.1\nValueError: boom\n", True)[:2] == ("red", "ValueError: boom")
    # a 161002 names CANN's reason (the EZ1001 line torch_npu prints after its own)
    refused = ("RuntimeError: x.cpp:40 NPU function error: call aclnnIndex failed, error code is 161002\n"
               "AclNN_Parameter_Error(EZ1001): Tensor self not implemented for DT_COMPLEX64, should be in dtype "
               "support list [DT_FLOAT,].\n")
    assert switch_off_matrix.classify(1, refused, False)[1].endswith(
        "error code is 161002: Tensor self not implemented for DT_COMPLEX64")
