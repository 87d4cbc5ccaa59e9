"""host_memory_check's upper bound is above the planner's figure, for every text model the rehearsal trains.

The rehearsal's start-up check skips the plan (15 to 30 s) when its in-process upper bound fits the host twice
over (npu_inject/patches/host_memory_check.py). That is safe only if the bound never falls below what the plan
would have said: here each training row of the model table (tools/model_table.py) is bounded and planned
(`npu-inject plan --hardware cpu --json`, the check's own planner) at the quickstart's shape and at a long one.
CI runs the quickstart's job (llama3); `-m models` runs every row at both shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from testkit import REPO, clean_env

GIB = 2**30
QUICKSTART = ("256", "2")  # --training.seq_len, --training.local_batch_size
LONG = ("2048", "8")
ROWS = (("llama3", "llama3_debugmodel"), ("llama3", "sft_debugmodel"), ("qwen3", "qwen3_debugmodel"),
        ("qwen3", "qwen3_moe_debug"), ("deepseek_v3", "deepseek_v3_debugmodel"), ("gpt_oss", "gpt_oss_debugmodel"),
        ("muse_glimmer", "muse_glimmer_debugmodel"), ("qwen3_5", "qwen35_debugmodel"))
CASES = [pytest.param(row, shape, marks=() if (row, shape) == (ROWS[0], QUICKSTART) else pytest.mark.models,
                      id=f"{row[1]}-seq{shape[0]}-batch{shape[1]}")
         for row in ROWS for shape in (QUICKSTART, LONG)]

BOUND = textwrap.dedent("""
    import json, sys
    from torchtitan.config.manager import ConfigManager
    from npu_inject.patches import host_memory_check
    bound, how = host_memory_check.upper_bound(ConfigManager().parse_args(sys.argv[1:]))
    print(json.dumps([bound, how]))
""")


@pytest.mark.parametrize("row, shape", CASES)
def test_the_bound_is_above_the_plan(row, shape, tmp_path):
    module, config = row
    argv = ["--module", module, "--config", config, "--training.seq_len", shape[0], "--training.local_batch_size",
            shape[1], "--validator.no-enable", "--checkpoint.no-enable"]
    # with the runtime on, as in a rank (qwen3_5's gated delta-net layers import fla's stand-in through it)
    bounded = subprocess.run([sys.executable, "-c", BOUND, *argv], env=clean_env(TORCHTITAN_NPU="cpu"),
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bounded.returncode == 0, bounded.stderr[-3000:]
    bound, how = json.loads(bounded.stdout.strip().splitlines()[-1])
    assert bound is not None, how
    plan = tmp_path / "plan.json"
    planned = subprocess.run([sys.executable, "-m", "npu_inject", "plan", "--hardware", "cpu", "--ngpu", "2",
                              "--json", str(plan), *argv, "--debug.no-spmd_typechecking"],
                             env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert plan.exists(), planned.stderr[-3000:]
    per_rank = max(role["total_bytes"] for role in json.loads(plan.read_text())["roles"])
    print(f"{config} seq {shape[0]} batch {shape[1]}: bound {bound / GIB:.3f} GiB per rank, planned "
          f"{per_rank / GIB:.3f} GiB ({bound / per_rank:.1f}x); {how}")
    assert bound >= per_rank
