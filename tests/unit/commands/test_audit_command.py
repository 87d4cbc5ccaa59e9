"""`npu-inject audit`: prints the simulated NPU's audit files and the CANN emulation's per-step counts as
tables (npu_inject/commands/audit.py, stdlib only)."""

from __future__ import annotations

import json
import re

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
    assert "no audit_rank<N>.json or cann_emu_rank<N>.json here" in capsys.readouterr().err


EXPECTED = ("expected a JSON object written by the simulated NPU (audit_rank<N>.json, schema 1) or the CANN "
            "emulation (cann_emu_rank<N>.json, schema 2 with 'soc')")


def test_an_empty_or_foreign_file_is_an_error_naming_it_and_what_was_expected(tmp_path, capsys):
    path = tmp_path / "audit_rank0.json"
    path.write_text("")
    assert main(["audit", str(path)]) == 2
    assert capsys.readouterr().err == f"npu-inject audit: error: {path}: empty file; {EXPECTED}\n"
    path.write_text('{"schema": 1,')
    assert main(["audit", str(tmp_path)]) == 2  # the folder holding it
    assert capsys.readouterr().err == (f"npu-inject audit: error: {path}:1:14: not JSON (Expecting property name "
                                       f"enclosed in double quotes); {EXPECTED}\n")
    path.write_text("[1, 2]")
    assert main(["audit", str(path)]) == 2
    assert capsys.readouterr().err == f"npu-inject audit: error: {path}: not an audit file (a JSON list); {EXPECTED}\n"


def _steps(aclnn, aicpu=None, aclop=None, syncs=None, hccl=None):
    return {"aclnn": aclnn, "aicpu": aicpu or {}, "aclop": aclop or {}, "syncs": syncs or {}, "hccl": hccl or {}}


# The shape verification/cann_emu/csrc/audit.cpp writes (schema 2), with numbers made up for the test.
CANN_EMU = {
    "schema": 2, "soc": "Ascend910B2", "pid": 42, "rank": 0,
    "aclnn": {"aclnnMm": 6, "aclnnRmsNorm": 2}, "aicpu": {}, "aclop": {}, "syncs": {}, "hccl": {},
    "steps": {
        "outside steps": _steps({"aclnnMm": 2}),
        "10": _steps({"aclnnMm": 2, "aclnnRmsNorm": 1}, syncs={"aclrtSynchronizeStream": 3}, hccl={"HcclAllGather": 4}),
        "2": _steps({"aclnnMm": 2, "aclnnRmsNorm": 1}, syncs={"aclrtMemcpy device-to-host": 1}),
    },
}


def test_cann_emulation_counts_print_per_step_in_step_order(tmp_path, capsys):
    (tmp_path / "npu_inject").mkdir()
    (tmp_path / "npu_inject" / "cann_emu_rank0.json").write_text(json.dumps(CANN_EMU))
    assert main(["audit", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(rank 0, Ascend910B2; the real torch_npu's calls into the CANN emulation)" in out
    operators = out[:out.index("Collectives per step")]
    steps = [line.split()[0] for line in operators.splitlines() if line.split()[:1] in (["2"], ["10"], ["outside"])]
    assert steps == ["2", "10", "outside"]
    row = next(line for line in out.splitlines() if line.startswith("10 "))
    assert "3 (2)" in row and "aclrtSynchronizeStream 3" in row and "HcclAllGather 4" in row
    assert "Operators CANN runs on AI CPU: 0" in out


def test_cann_emulation_collectives_split_into_standalone_and_inside_mc2_with_bytes(tmp_path, capsys):
    step = _steps({"aclnnAllGatherMatmul": 2, "aclnnMatmulReduceScatter": 1},
                  hccl={"HcclAllGather": 3, "aclnnAllGatherMatmul:HcclAllGather": 2,
                        "aclnnMatmulReduceScatter:HcclReduceScatter": 1, "HcclSetConfig": 9})
    step["hccl_bytes"] = {"HcclAllGather": 3 * 2**20, "aclnnAllGatherMatmul:HcclAllGather": 2**20,
                          "aclnnMatmulReduceScatter:HcclReduceScatter": 2**19}
    path = tmp_path / "cann_emu_rank0.json"
    path.write_text(json.dumps(dict(CANN_EMU, steps={"1": step})))
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out[out.index("Collectives per step"):].splitlines() if line.startswith("1 "))
    _, standalone, fused = re.split(r"\s{2,}", row.strip())
    assert standalone == "HcclAllGather 3 (3.00 MiB)"  # HcclSetConfig is no collective
    assert fused == ("aclnnAllGatherMatmul:HcclAllGather 2 (1.00 MiB), "
                     "aclnnMatmulReduceScatter:HcclReduceScatter 1 (0.50 MiB)")


def test_cann_emulation_syncs_by_owner_and_source_line(tmp_path, capsys):
    step = _steps({"aclnnMm": 1}, syncs={"aclrtSynchronizeStream": 3})
    step["sync_sites"] = {
        "aclrtSynchronizeStream | torchtitan | torchtitan/trainer.py:700 Trainer.train_step | torch/_tensor.py:1 item": 2,
        "aclrtSynchronizeStream | npu_inject | npu_inject/ops/attention.py:90 lengths | ": 1}
    path = tmp_path / "cann_emu_rank0.json"
    path.write_text(json.dumps(dict(CANN_EMU, steps={"1": step, "2": step})))
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  step 1: npu_inject 1, torchtitan 2" in out and "  step 2: npu_inject 1, torchtitan 2" in out
    table = out[out.index("Host synchronisations of step 2 by source line:"):].splitlines()
    assert re.split(r"\s{2,}", table[3].strip()) == [
        "2", "aclrtSynchronizeStream", "torchtitan", "torchtitan/trainer.py:700 Trainer.train_step",
        "torch/_tensor.py:1 item"]
    assert re.split(r"\s{2,}", table[4].strip()) == [
        "1", "aclrtSynchronizeStream", "npu_inject", "npu_inject/ops/attention.py:90 lengths"]


def test_cann_emulation_launches_of_the_last_step_by_model_scope_in_program_order(tmp_path, capsys):
    step = _steps({"aclnnMatmul": 9, "aclnnRmsNorm": 1, "aclnnApplyAdamWV2": 3, "aclnnMul": 1})
    step["scope_ops"] = {"forward: layers.0 | aclnnMatmul": 3, "forward: layers.0 | aclnnRmsNorm": 1,
                         "backward: layers.0 | aclnnMatmul": 6, "optimizer | aclnnApplyAdamWV2": 3,
                         "grad clipping | aclnnMul": 1}
    step["scope_order"] = {"forward: layers.0": 0, "backward: layers.0": 4, "grad clipping": 10, "optimizer": 11}
    path = tmp_path / "cann_emu_rank0.json"
    path.write_text(json.dumps(dict(CANN_EMU, steps={"1": _steps({"aclnnMm": 1}), "2": step})))
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("aclnn launches of step 2 by model scope"):].splitlines()[3:7]
    assert [re.split(r"\s{2,}", line.strip()) for line in table] == [
        ["forward: layers.0", "4", "Matmul 3, RmsNorm 1"], ["backward: layers.0", "6", "Matmul 6"],
        ["grad clipping", "1", "Mul 1"], ["optimizer", "3", "ApplyAdamWV2 3"]]


def test_cann_emulation_aicpu_or_aclop_operators_are_findings(tmp_path, capsys):
    document = dict(CANN_EMU, aclop={"TransData": 2})
    document["steps"] = dict(CANN_EMU["steps"], **{"2": _steps({"aclnnMm": 2}, aclop={"TransData": 2})})
    path = tmp_path / "cann_emu_rank1.json"
    path.write_text(json.dumps(document))
    assert main(["audit", str(path)]) == 1
    out = capsys.readouterr().out
    assert "Operators sent down the legacy aclop path: TransData 2" in out


def test_viewer_imports_neither_torch_nor_torchtitan():
    import ast
    import npu_inject.commands.audit as viewer

    tree = ast.parse(open(viewer.__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "argparse", "glob", "json", "os", "sys"}, imported


def test_cann_emulation_launch_sites_of_the_last_step_by_source_line(tmp_path, capsys):
    step = _steps({"aclnnInplaceCopy": 5})
    step["launch_sites"] = {
        "forward: layers.1 | aclnnInplaceCopy | torchtitan | torchtitan/models/common/decoder.py:238 Decoder.forward"
        " | torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:300 foreach_all_gather_copy_out": 3,
        "forward: layers.1 | aclnnInplaceCopy | npu_inject | npu_inject/ops/moe.py:204 permute_tokens_by_expert | ": 2}
    path = tmp_path / "cann_emu_rank0.json"
    path.write_text(json.dumps(dict(CANN_EMU, steps={"1": _steps({"aclnnMm": 1}), "2": step})))
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Launches of step 2 by source line"):].splitlines()
    assert re.split(r"\s{2,}", table[3].strip()) == [
        "3", "forward: layers.1", "InplaceCopy", "torchtitan", "torchtitan/models/common/decoder.py:238 Decoder.forward",
        "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:300 foreach_all_gather_copy_out"]
    assert re.split(r"\s{2,}", table[4].strip()) == [
        "2", "forward: layers.1", "InplaceCopy", "npu_inject", "npu_inject/ops/moe.py:204 permute_tokens_by_expert"]
