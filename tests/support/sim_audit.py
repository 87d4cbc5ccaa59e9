"""What the simulated NPU's audit may report for a training run, and why (verification/sim_npu, "Audit").

The e2e runs on simulated NPUs (TORCHTITAN_NPU_SIM_AUDIT=1) must show no stream-order
finding, no host-fallback op beyond KNOWN_FALLBACK_OPS, and inside training steps no host
sync beyond STEP_SYNCS (matched by kind and file: line numbers of npu_inject move). The
README lists the same entries; a new one fails here until it is explained there.
"""

from __future__ import annotations

import json
import os

# aten op -> why a real NPU runs it on the host, and the plan.
KNOWN_FALLBACK_OPS = {
    "aten::_assert_async.msg": (
        "torchtitan/models/common/rope.py checks position ids with torch._assert_async every "
        "forward; torch_npu 2.14.0 has no kernel for it (CPU fallback: copy to host, check). "
        "Plan: a patch skips the check on npu (positions come from the data loader)."
    ),
}

# (kind, file) -> why the host waits for the device inside a training step.
STEP_SYNCS = {
    ("blocking host-to-device copy", "torchtitan/trainer.py"):
        "inputs, labels and the valid-token count moved with .to(device) (torchtitan, blocking copies)",
    (".item() / bool() / tolist()", "torchtitan/trainer.py"):
        "int(global_valid_tokens) for the trace log and grad_norm.item() for the metrics line (torchtitan)",
    (".item() / bool() / tolist()", "torchtitan/distributed/utils.py"):
        "loss metrics: dist_mean/dist_max read with .item() for the metrics line (torchtitan)",
    ("data-dependent shape", "npu_inject/ops/attention.py"):
        "document boundaries (nonzero) for npu_fusion_attention_v3's TND lengths, which torch_npu reads "
        "from a CPU tensor; once per forward, shared by every layer",
    ("device-to-host copy", "npu_inject/ops/attention.py"):
        "the same document boundaries read with .tolist() (host ints for context parallel; the kernel's "
        "CPU tensor is built from them)",
    ("data-dependent shape", "torchtitan/models/common/attention.py"):
        "varlen metadata: document starts per batch row with nonzero (torchtitan, once per forward)",
    (".item() / bool() / tolist()", "torchtitan/models/common/attention.py"):
        "varlen metadata: max_seqlen read with .item() (torchtitan, once per forward)",
    ("device-to-host copy", "npu_inject/patches/attention.py"):
        "varlen: document ends copied to a CPU int64 tensor, where torch_npu's npu_fusion_attention_v3 "
        "reads its TND lengths (once per forward in eager, reused by every layer)",
    ("device-to-host copy", "torchtitan/models/common/token_dispatcher.py"):
        "MoE all-to-all split sizes, needed on the host by the collective (torchtitan)",
}


def _file(site: str) -> str:
    return site.rsplit(":", 1)[0]


def load_audits(folder: str, ranks=(0, 1)) -> list[dict]:
    """audit_rank<N>.json of each rank from ``folder`` (a dump folder or its npu_inject folder)."""
    if os.path.isdir(os.path.join(folder, "npu_inject")):
        folder = os.path.join(folder, "npu_inject")
    audits = []
    for rank in ranks:
        path = os.path.join(folder, f"audit_rank{rank}.json")
        assert os.path.exists(path), f"{path} missing: was TORCHTITAN_NPU_SIM_AUDIT=1 set?"
        with open(path, encoding="utf-8") as handle:
            audits.append(json.load(handle))
    return audits


def assert_audit_clean(folder: str, ranks=(0, 1), steps: int | None = None) -> list[dict]:
    """No stream-order finding, only explained fallback ops and in-step host syncs."""
    audits = load_audits(folder, ranks)
    for audit in audits:
        where = f"{folder} rank {audit['rank']}"
        assert audit["stream_findings"] == [], f"{where}: {audit['stream_findings']}"
        unexplained = sorted(set(audit["fallback_ops"]) - set(KNOWN_FALLBACK_OPS))
        assert not unexplained, f"{where}: host-fallback ops not in KNOWN_FALLBACK_OPS: " + "; ".join(
            f"{op} at {audit['fallback_ops'][op]['sites']}" for op in unexplained)
        if steps is not None:
            assert audit["steps"] == list(range(1, steps + 1)), f"{where}: steps {audit['steps']}"
        for step, rows in audit["syncs"].items():
            if step == "outside steps":
                continue
            unexplained = [row for row in rows if (row["kind"], _file(row["site"])) not in STEP_SYNCS]
            assert not unexplained, f"{where}: host syncs in step {step} not in STEP_SYNCS: {unexplained}"
    return audits
