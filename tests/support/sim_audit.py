"""What the simulated NPU's audit may report for a training run, and why (verification/sim_npu, "Audit").

The e2e runs on simulated NPUs (TORCHTITAN_NPU_SIM_AUDIT=1) must show no stream-order
finding, no host-fallback op beyond KNOWN_FALLBACK_OPS, and inside training steps no host
sync beyond STEP_SYNCS (matched by kind and file: line numbers of npu_inject move). The
README lists the same entries; a new one fails here until it is explained there.

An allow-list alone also passes an audit that saw nothing (one switched off or bypassed), so
each run must also show what it cannot train without: every step, NPU kernels (matmuls), the
known fallback once per layer and forward, and exactly the host syncs per step that the
README's table counts (expected_step_syncs).
"""

from __future__ import annotations

import json
import os
from collections import Counter

# aten op -> why a real NPU runs it on the host, and the plan.
KNOWN_FALLBACK_OPS: dict[str, str] = {
    # (none: torchtitan's RoPE check with torch._assert_async, which torch_npu 2.14.0 runs on the host, is
    # replaced by the positions_check patch, which reads the positions' shared host copy instead)
}

# (kind, file) -> why the host waits for the device inside a training step.
STEP_SYNCS = {
    ("blocking host-to-device copy", "torchtitan/trainer.py"):
        "inputs, labels and the valid-token count moved with .to(device) (torchtitan, blocking copies)",
    (".item() / bool() / tolist()", "torchtitan/trainer.py"):
        "int(global_valid_tokens) for the trace log and grad_norm.item() for the metrics line (torchtitan)",
    (".item() / bool() / tolist()", "torchtitan/distributed/utils.py"):
        "loss metrics: dist_mean/dist_max read with .item() for the metrics line (torchtitan)",
    (".item() / bool() / tolist()", "npu_inject/training_step.py"):
        "the gradient norm, read once before the optimizer runs (the step's owner, for finite_steps): a "
        "non-finite step is not applied",
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


ITEM = ".item() / bool() / tolist()"
H2D = "blocking host-to-device copy"
D2H = "device-to-host copy"
NONZERO = "data-dependent shape"

# Host syncs of every step whatever the model (README: "llama3 flex: 10").
TRAINER_STEP_SYNCS = {
    (H2D, "torchtitan/trainer.py"): 4,
    (ITEM, "torchtitan/trainer.py"): 2,
    (ITEM, "torchtitan/distributed/utils.py"): 3,
    (ITEM, "npu_inject/training_step.py"): 1,
}


def expected_step_syncs(attention: str, batch_rows: int = 0, moe_layers: int = 0) -> Counter:
    """Host syncs of one training step with one forward, by (kind, file), as the README's table
    counts them: the trainer's 10 (finite_steps' read of the gradient norm among them), then per forward nothing more for flex attention (its document boundaries'
    host copy is hidden from this audit, see below), or for varlen 1 nonzero per batch row, 1 .item() and 1 copy of
    the document ends; 1 copy of the all-to-all split sizes per MoE layer."""
    expected = Counter(TRAINER_STEP_SYNCS)
    if attention == "flex":
        # The document boundaries come from the positions' one host copy (npu_inject/ops/host_reads.py), made out
        # of sight of dispatch modes (selective AC must not see it): this audit cannot count it; the CANN
        # emulation does (docs/debugging.md).
        pass
    elif attention == "varlen" and batch_rows > 0:
        expected[(NONZERO, "torchtitan/models/common/attention.py")] += batch_rows
        expected[(ITEM, "torchtitan/models/common/attention.py")] += 1
        expected[(D2H, "npu_inject/patches/attention.py")] += 1
    else:
        raise ValueError(f"attention={attention!r}, batch_rows={batch_rows}: expected 'flex', or 'varlen' "
                         "with the local batch size as batch_rows")
    if moe_layers:
        expected[(D2H, "torchtitan/models/common/token_dispatcher.py")] += moe_layers
    unexplained = set(expected) - set(STEP_SYNCS)
    assert not unexplained, f"expected_step_syncs names syncs STEP_SYNCS does not explain: {unexplained}"
    return expected


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


def assert_audit_saw_training(audit: dict, steps: list[int], where: str) -> None:
    """The audit watched the run: every training step, and NPU kernels (matmuls) on the device."""
    assert audit.get("steps") == steps, f"{where}: audit saw steps {audit.get('steps')}, the run trained {steps}"
    kernels = audit.get("npu_kernels", {})
    assert kernels.get("aten::mm", 0) >= len(steps), (
        f"{where}: audit counted {kernels.get('aten::mm', 0)} aten::mm NPU kernels for {len(steps)} steps "
        f"(every step has matmuls): the dispatch mode did not see the device ops ({len(kernels)} ops seen)")


def assert_audit_clean(folder: str, steps: int, step_syncs: Counter, layers: int, ranks=(0, 1)) -> list[dict]:
    """No stream-order finding, only explained fallback ops and in-step host syncs; and the audit
    saw the run: ``steps`` steps, kernels, KNOWN_FALLBACK_OPS once per layer and forward
    (``layers`` transformer layers, one forward per step, no recomputation in the forward
    phase), and in every step exactly ``step_syncs`` (expected_step_syncs)."""
    audits = load_audits(folder, ranks)
    for audit in audits:
        where = f"{folder} rank {audit['rank']}"
        assert_audit_saw_training(audit, list(range(1, steps + 1)), where)
        assert audit["stream_findings"] == [], f"{where}: {audit['stream_findings']}"
        for op in KNOWN_FALLBACK_OPS:
            seen = audit["fallback_ops"].get(op, {}).get("phases", {}).get("forward", 0)
            assert seen == layers * steps, (
                f"{where}: {op} seen {seen} times in forward, expected once per layer and step "
                f"({layers} x {steps}); a change here changes the README's host-fallback table")
        unexplained = sorted(set(audit["fallback_ops"]) - set(KNOWN_FALLBACK_OPS))
        assert not unexplained, f"{where}: host-fallback ops not in KNOWN_FALLBACK_OPS: " + "; ".join(
            f"{op} at {audit['fallback_ops'][op]['sites']}" for op in unexplained)
        for step, rows in audit["syncs"].items():
            if step == "outside steps":
                continue
            unexplained = [row for row in rows if (row["kind"], _file(row["site"])) not in STEP_SYNCS]
            assert not unexplained, f"{where}: host syncs in step {step} not in STEP_SYNCS: {unexplained}"
        for step in range(1, steps + 1):
            seen = Counter()
            for row in audit["syncs"].get(str(step), []):
                seen[(row["kind"], _file(row["site"]))] += row["count"]
            assert seen == step_syncs, (
                f"{where}: host syncs in step {step} by (kind, file): {dict(seen)}, expected {dict(step_syncs)} "
                f"(the README's per-step table)")
    return audits
