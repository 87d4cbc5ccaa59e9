"""The test suite's warm launcher (tools/forklaunch.py) runs a training like torchrun does.

Every other end-to-end test relies on it, so it is checked against the real torchrun on the
path with the most start-up work: the bootstrap, the simulated torch_npu, hccl and the runtime
on 2 simulated NPUs. (Which runs it takes: tests/unit/tools/test_forklaunch_import_variables.py.)
"""

from __future__ import annotations

import json
import os
import re

from testkit import DETERMINISTIC, SHORT_RUN, clean_env, parse_losses, sim_npu_env, torchrun


def run(launcher_is_real: bool, dump: str):
    args = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "2", *SHORT_RUN,
            *DETERMINISTIC, "--dump_folder", dump, "--checkpoint.no-enable"]
    result = torchrun(args, sim_npu_env(), real=launcher_is_real)
    assert result.returncode == 0, result.stdout[-4000:]
    reports = [json.load(open(os.path.join(dump, "npu_inject", f"report_rank{rank}.json"))) for rank in (0, 1)]
    assert (result.args[0] == "forklaunch") != launcher_is_real, result.args  # each ran where it should
    return parse_losses(result.stdout), result.stdout, reports


def test_forked_ranks_train_like_torchrun_on_simulated_npus(tmp_path):
    forked, forked_log, forked_reports = run(False, str(tmp_path / "forked"))
    real, real_log, real_reports = run(True, str(tmp_path / "real"))
    assert sorted(forked) == [1, 2] and forked == real, (forked, real)
    for forked_report, real_report in zip(forked_reports, real_reports):
        assert forked_report["target"] == real_report["target"] == "npu"
        states = {key: record["state"] for key, record in forked_report["patches"].items()}
        assert states == {key: record["state"] for key, record in real_report["patches"].items()}
    summary = [line.split(" - ")[-1] for line in forked_log.splitlines() if "npu_inject: target=npu" in line]
    assert summary == [line.split(" - ")[-1] for line in real_log.splitlines() if "npu_inject: target=npu" in line]


def test_a_failing_rank_fails_the_launch_with_its_exit_code(tmp_path):
    result = torchrun(["--module", "llama3", "--config", "no_such_config"], clean_env(TORCHTITAN_NPU="cpu"))
    assert result.returncode == 1, result.stdout[-3000:]
    # Whichever rank fails first is reported with its exit code (the other may be reported as SIGTERMed).
    assert re.search(r"forklaunch: rank [01] failed: exitcode: [1-9]", result.stdout), result.stdout[-3000:]
