"""Ranks that applied different patches fail fast, naming ranks and patches (a runtime service)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from testkit import PLUGINS, clean_env, fake_entry, parse_losses, torchrun
from npu_inject.rank_agreement import mismatch_message


def test_agreeing_ranks_give_no_message():
    assert mismatch_message([["a", "b"], ["b", "a"], ["a", "b"]]) is None


def test_mismatch_names_ranks_and_patches():
    message = mismatch_message([["attention", "device"], ["device"], ["attention", "device", "extra"]])
    assert "rank 1 vs rank 0: only on rank 1: -; only on rank 0: ['attention']" in message
    assert "rank 2 vs rank 0: only on rank 2: ['extra']; only on rank 0: -" in message
    assert "same TORCHTITAN_NPU* environment" in message


@pytest.mark.e2e
def test_torchrun_with_rank_dependent_patch_fails_before_training(tmp_path):
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"patches": {"rank1_fails": fake_entry(
        "fake_patch_rank1_fails", triggers=["torchtitan.trainer"])}}))
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_REGISTRY=str(registry),
                    PYTHONPATH=os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")])))
    result = torchrun(["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "2",
                       "--training.seq_len", "64", "--checkpoint.no-enable", "--validator.no-enable",
                       "--dump_folder", str(tmp_path / "dump")], env)
    assert result.returncode != 0
    assert parse_losses(result.stdout) == {}, "no training step may run"
    assert ("npu_inject: ranks applied different patches, which would hang or corrupt collectives: "
            "rank 1 vs rank 0: only on rank 1: -; only on rank 0: ['rank1_fails']") in result.stdout
    report = json.load(open(tmp_path / "dump" / "npu_inject" / "report_rank1.json"))
    assert report["patches"]["rank1_fails"]["state"] == "failed"


def test_agreement_and_reports_are_runtime_services_that_no_selection_switches_off():
    import importlib

    from npu_inject import runtime

    trainer_module = importlib.import_module("torchtitan.trainer")
    upstream = trainer_module.Trainer.__dict__["init_distributed"]
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="none"))
    assert rt.ids("applied") == []
    installed = trainer_module.Trainer.__dict__["init_distributed"]
    assert installed is not upstream and installed.__wrapped__ is upstream
    runtime.deactivate()
    assert trainer_module.Trainer.__dict__["init_distributed"] is upstream


def test_every_rank_takes_rank0s_proposals():
    from npu_inject.rank_agreement import rank0_values

    assert rank0_values([{"p.dtype": "float32"}, {"p.dtype": "bfloat16"}]) == {"p.dtype": "float32"}


def test_ranks_proposing_different_names_fail_naming_them():
    from npu_inject.rank_agreement import rank0_values

    with pytest.raises(RuntimeError, match=r"rank 1 proposed \['p.other'\], rank 0 \['p.dtype'\]"):
        rank0_values([{"p.dtype": 1}, {"p.other": 1}])


def test_one_process_uses_its_own_proposal_and_writes_the_report(tmp_path):
    from npu_inject import rank_agreement
    from npu_inject.patching import PatchContext

    used = []
    context = PatchContext(patch_id="p", device_kind="cpu", options={})
    context.agree_with_rank0("dtype", "float32", used.append)
    written = []
    runtime = type("FakeRuntime", (), {
        "rank": 1,  # not rank 0: no summary line
        "states": {"p": type("State", (), {"context": context})()},
        "ids": lambda self, state: ["p"] if state == "applied" else [],
        "set_dump_folder": lambda self, folder: None,
        "write_report": lambda self: written.append(list(used)),
    })()
    rank_agreement.check_ranks_and_report(runtime, str(tmp_path), "cpu:0")
    assert used == ["float32"] and written == [["float32"]], "used before the report is written"
    assert context.agreements == [], "each agreement is used once"
    # the one process's place, which the patches that name a rank to drain print
    assert rank_agreement.who(0) == f"rank 0 ({socket.gethostname()}, cpu:0)" and rank_agreement.who(3) == "rank 3"
