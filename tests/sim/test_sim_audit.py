"""tests/support/sim_audit.py must fail an audit that saw nothing, not only one that saw too much.

A run's audit passing the allow-lists proves nothing when the audit was switched off or its
dispatch mode bypassed: such an audit writes a document with no kernels, fallbacks or syncs.
The healthy document below holds the rows a 2-step llama3_debugmodel run on 2 simulated NPUs
wrote (flex attention, 6 layers, activation checkpointing: the recompute adds backward-phase
fallbacks), per step and rank.
"""

from __future__ import annotations

import copy
import json

import pytest

from sim_audit import assert_audit_clean, expected_step_syncs

# One step's host syncs as written by the simulated NPU (llama3_debugmodel, local batch 2).
MEASURED_STEP_SYNCS = [
    {"kind": ".item() / bool() / tolist()", "op": "aten::_local_scalar_dense",
     "site": "torchtitan/distributed/utils.py:95", "count": 3},
    {"kind": ".item() / bool() / tolist()", "op": "aten::_local_scalar_dense",
     "site": "torchtitan/trainer.py:1008", "count": 1},
    {"kind": ".item() / bool() / tolist()", "op": "aten::_local_scalar_dense",
     "site": "torchtitan/trainer.py:959", "count": 1},
    {"kind": ".item() / bool() / tolist()", "op": "aten::_local_scalar_dense",
     "site": "npu_inject/training_step.py:107", "count": 1},
    {"kind": "blocking host-to-device copy", "op": "aten::_to_copy", "site": "torchtitan/trainer.py:900", "count": 1},
    {"kind": "blocking host-to-device copy", "op": "aten::_to_copy", "site": "torchtitan/trainer.py:913", "count": 2},
    {"kind": "blocking host-to-device copy", "op": "aten::_to_copy", "site": "torchtitan/trainer.py:915", "count": 1},
]
STEPS = 2
LAYERS = 6


def healthy(rank: int) -> dict:
    return {
        "schema": 1, "rank": rank, "steps": [1, 2],
        "fallback_ops": {},
        "syncs": {"outside steps": [{"kind": "synchronize", "op": "torch.npu.synchronize(npu:0)",
                                     "site": "torch_npu/npu.py:115", "count": 1}],
                  "1": copy.deepcopy(MEASURED_STEP_SYNCS), "2": copy.deepcopy(MEASURED_STEP_SYNCS)},
        "stream_findings": [], "streams": ["npu:0 stream 0", "npu:0 stream 1"],
        "npu_kernels": {"aten::mm": 90, "aten::add.Tensor": 40}, "composite_ops": {}, "fused_ops": {"npu_swiglu": 24},
    }


def write(tmp_path, documents) -> str:
    folder = tmp_path / "npu_inject"
    folder.mkdir()
    for document in documents:
        (folder / f"audit_rank{document['rank']}.json").write_text(json.dumps(document))
    return str(tmp_path)


def check(folder: str) -> None:
    assert_audit_clean(folder, steps=STEPS, layers=LAYERS, step_syncs=expected_step_syncs("flex"))


def test_the_measured_audit_passes(tmp_path):
    check(write(tmp_path, [healthy(0), healthy(1)]))


def disabled(document: dict) -> None:
    """What a switched-off or bypassed audit writes: the steps, nothing seen in them."""
    document.update(fallback_ops={}, syncs={}, streams=[], npu_kernels={}, composite_ops={}, fused_ops={})


def no_steps(document: dict) -> None:
    document.update(steps=[])
    disabled(document)


def unexplained_fallback(document: dict) -> None:
    document["fallback_ops"] = {"aten::_assert_async.msg": {
        "count": 24, "phases": {"forward": 12, "backward": 12}, "sites": {"torchtitan/models/common/rope.py:37": 24}}}


def sync_missing(document: dict) -> None:
    document["syncs"]["2"] = [row for row in document["syncs"]["2"] if "distributed/utils.py" not in row["site"]]


def sync_count_off(document: dict) -> None:
    document["syncs"]["1"][0]["count"] = 4


def kernels_unseen(document: dict) -> None:
    document["npu_kernels"] = {"aten::add.Tensor": 40}


@pytest.mark.parametrize("damage", [disabled, no_steps, unexplained_fallback, sync_missing, sync_count_off,
                                    kernels_unseen])
def test_an_audit_that_missed_what_the_run_does_fails(tmp_path, damage):
    rank1 = healthy(1)
    damage(rank1)
    with pytest.raises(AssertionError, match="rank 1"):
        check(write(tmp_path, [healthy(0), rank1]))


def test_expected_step_syncs_are_the_readme_counts():
    # README, "Host syncs per training step": llama3 flex 10 (the positions' host copy is hidden from this audit).
    assert sum(expected_step_syncs("flex").values()) == 10
    # varlen: 1 nonzero per batch row, 1 .item() and 1 copy of the document ends per forward.
    assert sum(expected_step_syncs("varlen", batch_rows=2).values()) == 10 + 2 + 1 + 1
    # MoE: 1 copy of the split sizes per MoE layer and forward.
    assert sum(expected_step_syncs("flex", moe_layers=5).values()) == 15
    with pytest.raises(ValueError, match="batch_rows"):
        expected_step_syncs("varlen")
