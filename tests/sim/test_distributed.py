"""Multi-process tests on 2 simulated NPUs with the "hccl" backend."""

from __future__ import annotations

import json

import pytest


@pytest.mark.e2e
def test_hccl_collectives_and_dtensor(run_ranks) -> None:
    # "philox": DTensor drives the npu RNG state through its offset tracker, as on a real NPU.
    outputs = run_ranks("collectives", env={"TORCHTITAN_NPU_SIM_DTENSOR_RNG": "philox"})
    assert all("collectives ok" in output for output in outputs)


@pytest.mark.e2e
def test_fsdp2_matches_cpu_and_dcp_round_trip(run_ranks, tmp_path) -> None:
    # Default DTensor RNG mode ("local"): random DTensor ops draw like on the CPU rehearsal.
    # The audit checks FSDP2's all-gather/reduce-scatter streams and DCP's staging for order.
    audit_dir = tmp_path / "audit"
    outputs = run_ranks("fsdp_dcp", str(tmp_path / "checkpoint"),
                        env={"TORCHTITAN_NPU_SIM_AUDIT": "1", "TORCHTITAN_NPU_SIM_AUDIT_DIR": str(audit_dir)})
    assert all("fsdp2+dcp ok" in output for output in outputs)
    for rank in (0, 1):
        audit = json.loads((audit_dir / f"audit_rank{rank}.json").read_text())
        assert audit["stream_findings"] == [], audit["stream_findings"]
        assert len(audit["streams"]) > 1, "FSDP2 used its side streams"
