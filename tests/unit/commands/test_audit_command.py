"""`npu-inject audit`: prints a simulated-NPU audit file as tables (npu_inject/commands/audit.py, stdlib only)."""

from __future__ import annotations

import json

from npu_inject.commands.cli import main

CLEAN = {
    "schema": 1, "rank": 0, "steps": [1, 2], "fallback_ops": {}, "stream_findings": [],
    "syncs": {"1": [{"kind": ".item() / bool() / tolist()", "op": "aten::_local_scalar_dense",
                     "site": "torchtitan/trainer.py:1008", "count": 1}],
              "outside steps": [{"kind": "synchronize", "op": "Event.synchronize", "site": "x.py:3", "count": 2}]},
}
BROKEN = dict(CLEAN, rank=1, fallback_ops={
    "aten::special_i0e": {"count": 3, "phases": {"forward": 2, "backward": 1}, "sites": {"model.py:7": 3}}},
    stream_findings=[{"finding": "read on npu:0 stream 0 by aten::mul of memory written on npu:0 stream 1", "count": 2}])


def _write(folder, rank, document):
    path = folder / f"audit_rank{rank}.json"
    path.write_text(json.dumps(document))
    return path


def test_clean_file_prints_sync_table_and_exits_zero(tmp_path, capsys):
    path = _write(tmp_path, 0, CLEAN)
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Host-fallback ops (no NPU kernel in torch_npu): 0" in out
    assert "Host syncs: 3" in out and "Stream-order findings: 0" in out
    row = next(line for line in out.splitlines() if "trainer.py:1008" in line)
    assert row.split()[:2] == ["1", ".item()"]


def test_dump_folder_with_findings_exits_one_and_names_them(tmp_path, capsys):
    (tmp_path / "npu_inject").mkdir()
    _write(tmp_path / "npu_inject", 0, CLEAN)
    _write(tmp_path / "npu_inject", 1, BROKEN)
    assert main(["audit", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "(rank 0, steps [1, 2])" in out and "(rank 1, steps [1, 2])" in out
    assert "aten::special_i0e" in out and "forward=2, backward=1" in out and "model.py:7" in out
    assert "[2x] read on npu:0 stream 0 by aten::mul" in out


def test_missing_path_is_an_error_naming_it(tmp_path, capsys):
    assert main(["audit", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'}: no such file or directory" in capsys.readouterr().err
    assert main(["audit", str(tmp_path)]) == 2
    assert "no audit_rank<N>.json here" in capsys.readouterr().err


def test_viewer_imports_neither_torch_nor_torchtitan():
    import ast
    import npu_inject.commands.audit as viewer

    tree = ast.parse(open(viewer.__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "argparse", "glob", "json", "os", "sys"}, imported
