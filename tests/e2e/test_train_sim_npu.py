"""TORCHTITAN_NPU=1 on 2 simulated NPUs (verification/sim_npu): the real NPU code path, end to end.

torchtitan must see an "npu" device and report NPU memory from the simulated
allocator, the process group must be hccl, and after set-up no parameter,
gradient or optimizer state may live on the host. Losses must match the CPU
rehearsal (same seed, fp32, deterministic) within 1e-4 relative per step. The
simulator's audit (tests/support/sim_audit.py) must find no stream-order problem, and only
the explained host-fallback ops and in-step host syncs.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from sim_audit import assert_audit_clean, expected_step_syncs
from testkit import LLAMA_STEPS, SHORT_RUN

CONFIGS = ("llama3_debugmodel", "llama3_debugmodel_varlen_attn")
ATTENTION = {"llama3_debugmodel": "flex", "llama3_debugmodel_varlen_attn": "varlen"}
LLAMA_LAYERS = 6  # llama3_debugmodel's n_layers


@pytest.mark.parametrize("config", CONFIGS)
def test_trains_on_simulated_npus_like_the_rehearsal(llama_runs, config):
    sim_losses, log, dump = llama_runs(config, "sim")
    assert "NPU capacity: Ascend910B-sim" in log
    assert "npu_inject: target=npu | torch_npu=2.14.0" in log
    memory = [float(m) for m in re.findall(r"memory:\s*(?:\x1b\[[0-9;]*m)?\s*([0-9.]+)GiB", log)]
    assert memory and all(figure > 0 for figure in memory), "NPU memory figures come from the allocator"
    for rank in (0, 1):
        audit = json.load(open(os.path.join(dump, f"device_audit_rank{rank}.json")))
        assert audit == {"parameters": ["npu"], "gradients": ["npu"], "optimizer_states": ["npu"],
                         "backend": "hccl", "device_type": "npu"}, audit
        report = json.load(open(os.path.join(dump, "npu_inject", f"report_rank{rank}.json")))
        assert report["versions"]["torch_npu_simulated"] == "yes"
        assert report["patches"]["attention"]["state"] == "applied"
    batch_rows = int(SHORT_RUN[SHORT_RUN.index("--training.local_batch_size") + 1])
    assert_audit_clean(dump, steps=LLAMA_STEPS, layers=LLAMA_LAYERS,
                       step_syncs=expected_step_syncs(ATTENTION[config], batch_rows=batch_rows))
    rehearsal, _, _ = llama_runs(config, "cpu")
    assert sorted(sim_losses) == list(range(1, LLAMA_STEPS + 1)) == sorted(rehearsal)
    worst = max(abs(sim_losses[s] - rehearsal[s]) / abs(rehearsal[s]) for s in rehearsal)
    print(f"{config}: simulated NPU vs CPU rehearsal, max relative loss difference: {worst:.2e}")
    assert worst <= 1e-4, (sim_losses, rehearsal)
