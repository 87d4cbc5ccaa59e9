"""torchtitan's dry runs through the runtime: upstream's run_train.sh with COMM_MODE, one process for NGPU ranks.

``COMM_MODE=fake_backend`` validates a configuration without communicating (torch's fake process
group); ``COMM_MODE=local_tensor`` sets the job up with every rank's tensors in one process and
skips training (upstream's behaviour: in 0.3.0 ``torchtitan.train`` returns before it builds the
trainer, so no process group is made at all). Both must work with ``TORCHTITAN_NPU=1`` on simulated NPUs
(torch registers the fake group for cpu/cuda/hpu/xpu only: patch ``collectives`` adds npu) and on
the rehearsal. The script is upstream's own, from a torchtitan checkout (release/0.3): $TORCHTITAN_SRC/run_train.sh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testkit import REPO, SHORT_RUN, TORCHTITAN_SRC, clean_env, needs_torchtitan_src, sim_npu_env

RUN_TRAIN = os.path.join(TORCHTITAN_SRC or "", "run_train.sh")
EXPECTED_LINE = {"fake_backend": "Training completed", "local_tensor": "Local tensor mode enabled - skipping training"}


def _env(target: str, mode: str) -> dict[str, str]:
    env = sim_npu_env(TORCHTITAN_NPU_SIM_DEVICES="4") if target == "npu" else clean_env(TORCHTITAN_NPU="cpu")
    # run_train.sh calls python3: this environment's interpreter, with the runtime's .pth in its site-packages.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(NGPU="4", COMM_MODE=mode, HF_HUB_OFFLINE="1")
    return env


def _report(env: dict[str, str], dump: str) -> dict:
    # local_tensor builds no trainer, so the runtime never learns the dump folder: TORCHTITAN_NPU_REPORT_DIR.
    for folder in (os.path.join(dump, "npu_inject"), env["TORCHTITAN_NPU_REPORT_DIR"]):
        path = os.path.join(folder, "report_rank0.json")
        if os.path.isfile(path):
            return json.load(open(path))
    raise AssertionError(f"no report_rank0.json under {dump} or {env['TORCHTITAN_NPU_REPORT_DIR']}")


@needs_torchtitan_src("run_train.sh")
@pytest.mark.parametrize("mode", sorted(EXPECTED_LINE))
@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_upstream_dry_run_works_on_the_target(tmp_path, target, mode):
    args = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
            *SHORT_RUN, "--dump_folder", str(tmp_path)]
    env = {**_env(target, mode), "TORCHTITAN_NPU_REPORT_DIR": str(tmp_path / "early_report")}
    done = subprocess.run(["bash", RUN_TRAIN, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert EXPECTED_LINE[mode] in output, output[-4000:]
    report = _report(env, str(tmp_path))
    assert report["target"] == target
    if target == "npu":
        assert report["versions"]["torch_npu_simulated"] == "yes"
    if mode == "fake_backend":
        collectives = report["patches"]["collectives"]
        assert collectives["state"] == "applied", collectives
        assert ("npu" == target) == any("fake process group serves npu" in note for note in collectives["notes"])
