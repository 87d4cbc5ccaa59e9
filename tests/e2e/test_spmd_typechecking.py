"""torchtitan's ``--debug.spmd_typechecking`` (spmd_types type checking of the forward) trains through
our patches: llama3 with context parallel 2 (fusion attention, CP's all-to-alls) for 2 steps, in the
CPU rehearsal and on 2 simulated NPUs, the switch last before ``activation-checkpoint:none`` as
upstream's integration suite passes it. In the rehearsal the losses equal those of the same run
without type checking (checking must not change the computation).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from testkit import DETERMINISTIC, SHORT_RUN, clean_env, parse_losses, sim_npu_env, torchrun

CP2 = ["--parallelism.context_parallel_degree", "2"]
TYPECHECKING = ["--debug.spmd_typechecking"]
TAIL = ["activation-checkpoint:none"]  # a subcommand: must come last


def train_llama3_cp2(dump: str, env: dict, extra: list[str]):
    """testkit.train_llama's deterministic run, with the subcommand tail last."""
    args = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "2", *SHORT_RUN,
            *DETERMINISTIC, "--dump_folder", dump, "--checkpoint.no-enable", *CP2, *extra, *TAIL]
    result = torchrun(args, env)
    assert result.returncode == 0, result.stdout[-6000:]
    return parse_losses(result.stdout), result.stdout


@pytest.mark.parametrize("target", ["cpu", "sim"])
def test_context_parallel_trains_under_spmd_type_checking(target, tmp_path):
    env = clean_env(TORCHTITAN_NPU="cpu") if target == "cpu" else sim_npu_env()
    dump = str(tmp_path / "checked")
    checked, log = train_llama3_cp2(dump, env, TYPECHECKING)
    assert sorted(checked) == [1, 2] and all(math.isfinite(loss) for loss in checked.values()), log[-3000:]
    report = json.load(open(os.path.join(dump, "npu_inject", "report_rank0.json")))
    assert report["patches"]["attention"]["state"] == "applied"
    assert any("scheme 'ulysses' ran" in note for note in report["patches"]["context_parallel"]["notes"])
    if target == "cpu":
        unchecked, _ = train_llama3_cp2(str(tmp_path / "unchecked"), env, [])
        print(f"{target}: type-checked {checked}, unchecked {unchecked}")
        assert checked == unchecked
    else:
        print(f"{target}: type-checked {checked}")
