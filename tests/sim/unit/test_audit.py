"""The simulated NPU's audit (torch_npu._audit) catches each kind of problem it exists for.

Each broken case is a plain PyTorch program that would misbehave on a real NPU: an op
torch_npu 2.14.0 has no kernel for, a ``.item()`` inside a training step, a copy on a
side stream read without waiting for it. The op lists come from the real wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch_npu
from torch_npu import _audit


@pytest.fixture(scope="module")
def op_names() -> frozenset[str]:
    return _audit.load_npu_op_names()


@pytest.fixture
def audit(op_names):
    with _audit.Audit(op_names) as running:
        yield running


def test_op_lists_come_from_the_wheel(op_names):
    # Independent facts about torch_npu 2.14.0's npu_native_functions*.yaml.
    assert {"mm", "add.Tensor", "_fused_adamw_", "npu_fusion_attention", "nonzero"} <= op_names
    assert "_grouped_mm" not in op_names and "special_i0e" not in op_names


def test_classifies_listed_composite_and_fallback_ops(audit):
    x = torch.randn(4, 4, device="npu")
    y = x @ x + 1  # mm, add.Tensor: listed
    y.t()  # transpose: torch's CompositeExplicitAutograd view on every device
    torch.special.i0e(x)  # structured op; torch_npu lists neither i0e nor special_i0e.out
    assert audit.npu_kernels["aten::mm"] == 1 and audit.npu_kernels["aten::add.Tensor"] == 1
    assert audit.composite_ops["aten::t"] == 1
    assert list(audit.fallback_ops) == ["aten::special_i0e"]
    record = audit.fallback_ops["aten::special_i0e"]
    assert record["count"] == 1 and record["phases"] == {"outside steps": 1}
    assert [site.split(":")[0] for site in record["sites"]] == ["tests/sim/unit/test_audit.py"]


def test_fallback_is_fatal_when_asked(op_names):
    x = torch.randn(4, device="npu")
    with _audit.Audit(op_names, fail=frozenset({"fallback"})):
        torch.abs(x)
        with pytest.raises(_audit.AuditError, match="aten::special_i0e would run on the host"):
            torch.special.i0e(x)


def test_item_in_a_step_is_a_host_sync_with_its_site(audit):
    x = torch.randn(8, device="npu")
    audit.on_step_start(3)
    total = x.sum().item()  # the broken line
    line = sys._getframe().f_lineno - 1
    x[x > 0].sum()  # boolean indexing: data-dependent shape
    cpu = x.cpu()  # blocking device-to-host copy
    audit.on_step_end()
    assert isinstance(total, float) and cpu.device.type == "cpu"
    rows = audit.report(0)["syncs"]["3"]
    kinds = {row["kind"]: row for row in rows}
    assert kinds[".item() / bool() / tolist()"]["site"] == f"tests/sim/unit/test_audit.py:{line}"
    assert "data-dependent shape (boolean indexing)" in kinds or "data-dependent shape" in kinds
    assert kinds["device-to-host copy"]["count"] == 1
    assert "outside steps" not in audit.report(0)["syncs"]


def test_sync_is_fatal_in_a_step_when_asked(op_names):
    x = torch.randn(8, device="npu")
    with _audit.Audit(op_names, fail=frozenset({"sync"})) as running:
        x.sum().item()  # outside a step: counted, not fatal
        running.on_step_start(1)
        with pytest.raises(_audit.AuditError, match=r"host sync in training step 1: \.item\(\)"):
            x.sum().item()
        running.on_step_end()


def _side_stream_copy(wait: bool) -> None:
    side = torch.npu.Stream()
    source = torch.randn(1024, device="npu")
    target = torch.empty(1024, device="npu")
    side.wait_stream(torch.npu.current_stream())  # the side stream may read what the default stream wrote
    with torch.npu.stream(side):
        target.copy_(source)  # written on the side stream
    if wait:
        torch.npu.current_stream().wait_stream(side)
    target.mul_(2)  # read and written on the default stream


def test_missing_stream_wait_is_found_with_both_sites(audit):
    _side_stream_copy(wait=False)
    findings = audit.report(0)["stream_findings"]
    assert len(findings) == 1, findings
    text = findings[0]["finding"]
    assert text.startswith("write on npu:0 stream 0 by aten::mul_.Tensor at tests/sim/unit/test_audit.py:")
    assert "of memory written on npu:0 stream " in text and "by aten::copy_ at tests/sim/unit/test_audit.py:" in text


def test_waited_stream_and_event_orders_are_clean(audit):
    _side_stream_copy(wait=True)
    side = torch.npu.Stream()
    buffer = torch.ones(16, device="npu")
    side.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(side):
        buffer.add_(1)
        done = side.record_event()
    torch.npu.current_stream().wait_event(done)
    buffer.mul_(3)
    # Write-after-read: the side stream may overwrite only after the default stream's read.
    read_done = torch.npu.current_stream().record_event()
    side.wait_event(read_done)
    with torch.npu.stream(side):
        buffer.zero_()
    assert audit.report(0)["stream_findings"] == []


def test_write_after_unwaited_read_is_found(audit):
    side = torch.npu.Stream()
    buffer = torch.ones(16, device="npu")
    side.wait_stream(torch.npu.current_stream())  # ordered after the write, not after the read below
    buffer.sum()  # read on the default stream
    with torch.npu.stream(side):
        buffer.zero_()  # overwritten on the side stream, not ordered after the read
    findings = audit.report(0)["stream_findings"]
    assert len(findings) == 1 and "of memory read on npu:0 stream 0 by aten::sum" in findings[0]["finding"]


def test_disjoint_views_of_one_buffer_on_two_streams_do_not_race(audit):
    side = torch.npu.Stream()
    arena = torch.zeros(2, 64, device="npu")
    side.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(side):
        arena[1].fill_(1)  # prefetch of the next slice
    arena[0].mul_(2)  # update of this slice, on the other half
    assert audit.report(0)["stream_findings"] == []
    arena[1].mul_(2)  # the prefetched half, without waiting for the side stream
    assert len(audit.report(0)["stream_findings"]) == 1


def test_pinned_host_buffer_read_after_event_synchronize_is_clean(audit):
    side = torch.npu.Stream()
    source = torch.randn(64, device="npu")
    staging = torch.empty(64, pin_memory=True)
    side.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(side):
        staging.copy_(source, non_blocking=True)
        copied = side.record_event()
    copied.synchronize()
    staging.sum()  # host read after the host waited for the copy
    assert audit.report(0)["stream_findings"] == []
    staging.copy_(source, non_blocking=True)  # default stream writes it again, asynchronously
    staging.add_(1)  # host write racing the copy
    findings = audit.report(0)["stream_findings"]
    assert len(findings) == 1 and findings[0]["finding"].startswith("write on the host by aten::add_.Tensor")


AUDITED_CHILD = """
import os, torch, torch_npu
from torch_npu import _audit
assert _audit.active() is not None
x = torch.randn(4, device="npu")
torch.special.i0e(x)
print(_audit.write_report())
"""


def test_switch_writes_one_file_per_rank(tmp_path):
    env = dict(os.environ, TORCHTITAN_NPU_SIM_AUDIT="1", TORCHTITAN_NPU_SIM_AUDIT_DIR=str(tmp_path), RANK="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(AUDITED_CHILD)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "aten::special_i0e has no NPU kernel in torch_npu 2.14.0" in done.stderr  # warned once
    document = json.loads((tmp_path / "audit_rank1.json").read_text())
    assert document["rank"] == 1 and list(document["fallback_ops"]) == ["aten::special_i0e"]


def test_unknown_fail_kind_is_rejected(monkeypatch):
    monkeypatch.setenv(_audit.FAIL_VAR, "fallback,speed")
    with pytest.raises(ValueError, match=r"unknown kinds \['speed'\]; valid: fallback, sync, stream"):
        _audit.fail_kinds_from_env()


def test_stand_in_is_simulated():
    assert torch_npu.__simulated__


def test_fused_kernel_counts_once_and_its_backward_runs(audit):
    # torch_npu's npu_fusion_attention is one kernel forward and one backward on a real NPU;
    # the stand-in's reference backward (torch.func.vjp) must also run under the audit.
    query = torch.randn(1, 4, 2, 8, device="npu", requires_grad=True)
    out = torch_npu.npu_fusion_attention(query, query, query, 2, "BSND", scale=0.25)[0]
    out.sum().backward()
    report = audit.report(0)
    assert query.grad is not None and query.grad.shape == query.shape
    assert report["fused_ops"]["npu_fusion_attention"] == 1
    assert report["fused_ops"]["(backward of fused kernels)"] == 1
    assert report["fallback_ops"] == {}
