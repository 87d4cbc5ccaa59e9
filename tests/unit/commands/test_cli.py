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
    env.setenv("COLUMNS", "250")
    assert cli.main(["list"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "target: cpu"
    assert table.splitlines()[1].split() == ["id", "state", "default", "triggers", "supports", "description"]
    assert max(len(line) for line in table.splitlines()) <= 250
    row = next(line for line in table.splitlines() if line.startswith("attention "))
    assert row.split()[1:3] == ["off", "on"]
    assert cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    states = {p["id"]: p["state"] for p in data["patches"]}
    assert states["attention"] == "off" and states["device"] == "on"


def test_list_without_a_target_says_nothing_applies_and_fits_the_terminal(env, capsys):
    """TORCHTITAN_NPU unset: no row may say a plain "on"; an 80-column terminal gets an 80-column table."""
    env.setenv("COLUMNS", "80")
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert " ".join(lines[:3]).startswith("target: off (TORCHTITAN_NPU unset or 0): no patch applies.")
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    header = next(line for line in lines if line.startswith("id "))
    assert header.split() == ["id", "state", "default", "description"]
    assert lines[-1] == "(triggers, supports: npu-inject show ID or npu-inject list --json)"
    rows = {line.split("  ")[0]: line for line in lines if line[:1].isalpha() and not line.startswith("target")}
    assert "on when set" in rows["device"] and "on for cpu" in rows["rehearsal_dtype"]
    assert rows["swap_optimizer"].split()[1:3] == ["off", "off"]
    assert cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    patches = {p["id"]: p for p in data["patches"]}
    assert data["target"] is None and patches["device"]["state"] == "on when set"
    # the description wraps in the table; --json has it whole
    description = patches["checkpoint_publish"]["description"]
    assert len(description) > 40 and description not in "\n".join(lines)


def test_list_wraps_a_long_state_and_says_off_once(env, capsys):
    env.setenv("TORCHTITAN_NPU", "cpu")
    env.setenv("TORCHTITAN_NPU_PATCHES", "-optimizer")
    env.setenv("COLUMNS", "100")
    assert cli.main(["list", "--json"]) == 0
    state = {p["id"]: p["state"] for p in json.loads(capsys.readouterr().out)["patches"]}["swap_optimizer"]
    assert state == "off (requires optimizer, which the selection turned off)"
    assert cli.main(["list"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100


@pytest.mark.parametrize("command", ["list", "show", "check", "doctor", "audit", "flight-recorder"])
def test_every_command_describes_itself_in_its_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    paragraphs = capsys.readouterr().out.split("\n\n")
    assert paragraphs[0].startswith(f"usage: npu-inject {command}")
    description = " ".join(paragraphs[1].split())
    assert not description.startswith(("positional arguments", "options")) and len(description) > 40, paragraphs


def test_show_one_patch(env, capsys):
    assert cli.main(["show", "device"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["triggers"] == ["torchtitan.tools.utils"] and shown["state"] == "on when set"  # TORCHTITAN_NPU unset
    env.setenv("TORCHTITAN_NPU", "cpu")
    assert cli.main(["show", "device"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "on"
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


def test_check_finds_a_user_patch_whose_module_does_not_exist(env, capsys, tmp_path):
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"patches": {"mine": {"module": "no_such_patch_module", "triggers": ["torchtitan.trainer"]}}}))
    env.setenv("TORCHTITAN_NPU", "cpu")
    env.setenv("TORCHTITAN_NPU_REGISTRY", str(user))
    expected = (f"npu-inject: error: {user}: patch 'mine': module 'no_such_patch_module' not found (no source file "
                "on sys.path); 'module' must name the Python module holding the patch, importable where the run "
                "starts\n")
    for command in (["check"], ["list"], ["show", "mine"]):
        assert cli.main(command) == 2
        captured = capsys.readouterr()
        assert captured.err == expected and captured.out == "", command
    (tmp_path / "mine_patch.py").write_text("TARGETS = ('torchtitan.trainer:Trainer.train',)\n")
    env.syspath_prepend(str(tmp_path))
    user.write_text(json.dumps({"patches": {"mine": {"module": "mine_patch", "triggers": ["torchtitan.trainer"]}}}))
    assert cli.main(["check"]) == 2
    assert capsys.readouterr().err.startswith(
        f"npu-inject: error: {user}: patch 'mine': module 'mine_patch': {tmp_path / 'mine_patch.py'}: a patch module "
        "starts with a docstring")


def test_doctor_reports_versions_and_targets(env, capsys):
    env.setenv("TORCHTITAN_NPU", "cpu")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torchtitan     0.3.0" in out
    assert "  attention          ok" in out


def _without_torchft(env):
    """As on a machine that installed npu-inject without its torchft extra (the README's plain install)."""
    from npu_inject import selection

    real = selection.installed_version
    env.setattr(selection, "installed_version", lambda name: None if name == "torchft" else real(name))


def test_doctor_without_an_optional_package_is_ok_and_names_what_it_did_not_check(env, capsys):
    env.setenv("TORCHTITAN_NPU", "cpu")
    _without_torchft(env)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "problem" not in out.lower()
    assert "  torchft        -" in out
    hint = "torchft is not installed; to use it: pip install 'torchft~=0.2.0' (npu-inject's torchft extra)"
    for patch_id in ("torchft_commits", "torchft_heal", "torchft_leave"):
        assert f"  {patch_id:18} not applicable: {hint}" in out
    unchecked = next(line for line in out.splitlines() if line.startswith("not checked"))
    assert "torchft_commits, torchft_heal, torchft_leave (torchft not installed)" in unchecked
    assert "torchft_npu, torchft_recover, uce_repair, step_repair (runs only on npu)" in unchecked
    assert "swap_optimizer, spikes, matmul_checks, replica_check, inject_faults (off by selection)" in unchecked
    env.setenv("COLUMNS", "250")
    assert cli.main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("torchft_heal "))
    assert "n/a (torchft not installed)" in row


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


def test_a_reader_that_goes_away_is_not_an_error(tmp_path):
    """`npu-inject list --json | head -1`: the reader closes the pipe; no BrokenPipeError traceback, exit 0."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    run = subprocess.run([sys.executable, "-c", "from npu_inject.commands.cli import _entry; _entry()", "list", "--json"],
                         stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert run.returncode == 0 and "BrokenPipeError" not in run.stderr, run.stderr
