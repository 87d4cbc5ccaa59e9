"""Multi-process tests on 2 simulated NPUs with the "hccl" backend."""

from __future__ import annotations

import pytest


@pytest.mark.e2e
def test_hccl_collectives_and_dtensor(run_ranks) -> None:
    outputs = run_ranks("collectives")
    assert all("collectives ok" in output for output in outputs)


@pytest.mark.e2e
def test_fsdp2_matches_cpu_and_dcp_round_trip(run_ranks, tmp_path) -> None:
    outputs = run_ranks("fsdp_dcp", str(tmp_path / "checkpoint"))
    assert all("fsdp2+dcp ok" in output for output in outputs)
