"""npu-inject list / show / check / doctor."""

from __future__ import annotations

import json

import pytest

from npu_inject.commands import cli


@pytest.fixture
def env(monkeypatch):
    for name in ("TORCHTITAN_NPU", "TORCHTITAN_NPU_PATCHES", "TORCHTITAN_NPU_REGISTRY", "TORCHTITAN_NPU_STRICT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_list_table_and_json(env, capsys):
    env.setenv("TORCHTITAN_NPU", "cpu")
    env.setenv("TORCHTITAN_NPU_PATCHES", "-attention")
    assert cli.main(["list"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "target: cpu"
    assert table.splitlines()[1].split() == ["id", "state", "default", "triggers", "supports", "description"]
    row = next(line for line in table.splitlines() if line.startswith("attention "))
    assert row.split()[1:3] == ["off", "on"]
    assert cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    states = {p["id"]: p["state"] for p in data["patches"]}
    assert states["attention"] == "off" and states["device"] == "on"


def test_show_one_patch(env, capsys):
    assert cli.main(["show", "device"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["triggers"] == ["torchtitan.tools.utils"] and shown["state"] == "on"
    assert cli.main(["show", "devise"]) == 2
    assert "unknown patch 'devise'; did you mean device?" in capsys.readouterr().err


def test_check_ok_and_errors(env, capsys, tmp_path):
    env.setenv("TORCHTITAN_NPU", "cpu")
    assert cli.main(["check"]) == 0
    assert capsys.readouterr().out.startswith("OK: target=cpu")
    env.setenv("TORCHTITAN_NPU_PATCHES", "-device,+attention")
    assert cli.main(["check"]) == 2
    assert "requires 'device', which is disabled; enable it (+device)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    env.setenv("TORCHTITAN_NPU_PATCHES", "")
    env.setenv("TORCHTITAN_NPU_REGISTRY", str(bad))
    assert cli.main(["check"]) == 2
    assert f"{bad}:1:2: malformed JSON" in capsys.readouterr().err


def test_doctor_reports_versions_and_targets(env, capsys):
    env.setenv("TORCHTITAN_NPU", "cpu")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torchtitan     0.3.0" in out
    assert "  attention          ok" in out


def test_doctor_finds_missing_targets(env, capsys, tmp_path):
    (tmp_path / "mine_patch.py").write_text(
        '"""A local patch."""\n\nTARGETS = ("torchtitan.trainer:Trainer.no_such_method", "torchtitan.nowhere:thing")\n')
    env.syspath_prepend(str(tmp_path))
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"patches": {"mine": {
        "module": "mine_patch", "triggers": ["torchtitan.trainer"], "supports": {"torchtitan": ">=9"}}}}))
    env.setenv("TORCHTITAN_NPU_REGISTRY", str(user))
    assert cli.main(["doctor"]) == 2
    line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("mine"))
    assert "torchtitan 0.3.0 is outside the supported range >=9" in line
    # Trainer has base classes: a name it does not define may be inherited (not checked without importing)
    assert "Trainer.no_such_method: inherited from" in line and "module torchtitan.nowhere not found" in line


def test_target_status_reads_sources_without_importing():
    from testkit import clean_env, run_python

    code = """
        import sys
        from npu_inject.commands import cli
        for target in ("torchtitan.models.common.attention:FlexAttention.forward",
                       "torchtitan.tools.utils:device_type",
                       "torchtitan.distributed.minimal_async_ep.kernels:*"):
            assert cli.target_status(target).startswith("ok"), target
        print(sorted(m for m in sys.modules if m.startswith(("torch", "torchtitan"))))
    """
    result = run_python(code, clean_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("command", [["list"], ["show", "attention"], ["check"], ["doctor"]])
def test_commands_never_activate_or_import_heavy_modules(command):
    """With TORCHTITAN_NPU=1 and no torch_npu (a machine users run doctor on), in a fresh interpreter."""
    from testkit import clean_env, run_python

    code = f"""
        import sys
        from npu_inject.commands import cli
        code = cli.main({command!r})
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("torch", "torchtitan", "wrapt", "torch_npu") or m == "npu_inject.runtime")
        print("EXIT", code, heavy)
    """
    result = run_python(code, clean_env(TORCHTITAN_NPU="1"))
    assert result.returncode == 0, result.stderr
    exit_line = result.stdout.strip().splitlines()[-1]
    expected_exit = 2 if command == ["doctor"] else 0
    assert exit_line == f"EXIT {expected_exit} []", result.stdout
    if command == ["doctor"]:
        # the whole report: versions, the torch_npu problem marked, every enabled patch, a count
        assert "torch_npu import: PROBLEM: import torch_npu failed" in result.stdout
        assert "patches enabled for target npu:" in result.stdout
        assert "  cuda_graphs        ok" in result.stdout
        assert "problem(s)" in result.stdout
