"""``npu-inject suite``: case loading from upstream's lists, step shortening, root causes, the matrix."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from npu_inject.commands import suite
from testkit import REPO, TORCHTITAN_SRC, needs_torchtitan_src

needs_case_lists = needs_torchtitan_src("tests/integration_tests")


@needs_case_lists
def test_cases_come_from_upstreams_lists_without_the_disabled_ones():
    cases = suite.load_cases(TORCHTITAN_SRC, ["features", "models"])
    names = {case.name for case in cases}
    assert {"default", "full_checkpoint", "pp_1f1b", "ddp", "cp", "1d_compile"} <= names
    assert "2d_asynctp_compile" not in names  # disabled upstream
    full_checkpoint = next(case for case in cases if case.name == "full_checkpoint")
    assert len(full_checkpoint.runs) == 2 and full_checkpoint.ngpu == 4  # save, then resume
    resume = full_checkpoint.runs[1]
    assert resume[resume.index("--training.steps") + 1] == "20"
    assert any(case.suite == "models" for case in cases)


def test_shortened_runs_keep_what_a_case_checks():
    # A resume to step 20 stays a resume (twice the first run), paths to the last step follow it.
    assert suite.shorten(["--checkpoint.enable"], 2) == ["--checkpoint.enable", "--training.steps", "2"]
    assert suite.shorten(["--checkpoint.enable", "--training.steps", "20"], 2) == [
        "--checkpoint.enable", "--training.steps", "4"]
    assert suite.shorten(["--checkpoint.initial_load_path", "out/hf_checkpoint/step-10/"], 3) == [
        "--checkpoint.initial_load_path", "out/hf_checkpoint/step-3/", "--training.steps", "3"]
    # Subcommands stay last: torchtitan's parser takes no flag after them.
    assert suite.shorten(["--parallelism.data_parallel_replicate_degree=4", "activation-checkpoint:none"], 2) == [
        "--parallelism.data_parallel_replicate_degree=4", "--training.steps", "2", "activation-checkpoint:none"]


ROOT_CAUSES = [
    ('Traceback (most recent call last):\n  File "/x/site-packages/npu_inject/ops/attention.py", line 3, in f\n'
     '[rank0]: spmd_types.types.SpmdTypeError: args[0] missing axis\n', "SpmdTypeError: args[0] missing axis", "this project"),
    ('  File "/x/site-packages/torchtitan/distributed/utils.py", line 9, in g\n'
     'RuntimeError: Distributed package has no NCCL built in\n', "RuntimeError", "torchtitan CUDA-only by design"),
    ('  File "/x/site-packages/torch/nn/functional.py", line 9, in g\nRuntimeError: view size is not compatible\n',
     "view size", "torch"),
    ('  File "/x/site-packages/torch_npu/npu/utils.py", line 9, in g\nRuntimeError: bad device\n', "bad device",
     "torch_npu"),
    ("torchrun ... exitcode  : -9 (pid: 12)\n", "killed", "host memory"),
    ("[rank3]:[titan] Training completed\n[rank3]:terminate called without an active exception\n"
     "[rank3]:Fatal Python error: Aborted\n", "rank 3 aborted after training completed", "unknown"),
    ("│ Unrecognized or misplaced options: │\n", "config parser", "torchtitan"),
    ("│ Config function 'llama3_debugmodel_fsdp2_cp2' not found in torchtitan_recipes.tests. Available config "
     "functions: [] │\n", "torchtitan checkout", "torchtitan (packaging)"),
    ("[rank0]:│ Error parsing checkpoint: initial_load_path must be an absolute path │\n", "Error parsing checkpoint",
     "torchtitan"),
    # torchrun's summary in rank order: rank 0 only saw its peer fail (HCCL), rank 7 failed first
    ("  RuntimeError: The Inner error is reported as above. The process exits for this inner error, and the current "
     "working operator name is hcclGroupEnd.\n"
     '  File "/x/site-packages/torch_npu/utils/_error_code.py", line 9, in g\n'
     "  RuntimeError: call aclnnIndex failed, error code is 161002\n", "aclnnIndex failed", "torch_npu"),
    ("[rank7]:[rank7]: ValueError: the first one\n[rank2]: RuntimeError: hcclGroupEnd\n", "the first one", "unknown"),
]


@pytest.mark.parametrize("output,expected,who", ROOT_CAUSES)
def test_root_cause_names_the_error_and_who_owns_it(output, expected, who):
    cause, attributed = suite.root_cause(output + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: x\n")
    assert expected in cause and attributed == who, (cause, attributed)


def _fake_run_train(tmp_path, script: str) -> str:
    path = tmp_path / "run_train.sh"
    path.write_text(script)
    return str(path)


def _args(tmp_path, run_train, **overrides):
    values = dict(steps=2, shrink=None, case_timeout=20, run_train=run_train)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_a_case_is_green_stopped_red_or_timed_out(tmp_path):
    case = suite.Case("features", "demo", "demo", 2, [["--checkpoint.enable"], ["--training.steps", "20"]], None)
    env = dict(os.environ)
    green = _fake_run_train(tmp_path, 'echo "step:  1  loss:  8.1"; echo "step:  2  loss:  7.5"\n')
    result = suite.run_case(case, _args(tmp_path, green), str(tmp_path / "g"), env)
    assert (result.status, result.runs, result.first_loss, result.last_loss) == ("green", 2, 8.1, 7.5)
    stop = _fake_run_train(tmp_path, 'echo "SystemExit: npu_inject model_guard: --module flux needs transformers"; exit 1\n')
    result = suite.run_case(case, _args(tmp_path, stop), str(tmp_path / "s"), env)
    assert result.status == "stopped" and "needs transformers" in result.cause and result.runs == 1
    red = _fake_run_train(tmp_path, 'echo "step:  1  loss:  8.1"\necho "ValueError: boom"; exit 1\n')
    result = suite.run_case(case, _args(tmp_path, red), str(tmp_path / "r"), env)
    assert result.status == "red" and result.cause == "ValueError: boom"
    recipes = _fake_run_train(tmp_path, "echo \"│ Config function 'x' not found in torchtitan_recipes.tests. │\"; exit 1\n")
    result = suite.run_case(case, _args(tmp_path, recipes), str(tmp_path / "p"), env)
    assert (result.status, result.attributed_to) == ("stopped", "torchtitan (packaging)"), result
    hang = _fake_run_train(tmp_path, "sleep 60\n")
    result = suite.run_case(case, _args(tmp_path, hang, case_timeout=2), str(tmp_path / "h"), env)
    assert result.status == "timeout" and result.seconds < 40


def test_matrix_lists_every_case_and_the_totals():
    results = [suite.Result("features", "ddp", 4, "green", 12.0, 8.1, 7.2, "", "", 1, 1.5, True, "cmd"),
               suite.Result("models", "x", 8, "red", 3.0, None, None, "ValueError: a|b", "torch", 1, None, False, "c")]
    text = suite.render_markdown(results, {"target": "cpu", "date": "d", "machine": "m", "command": "c"})
    assert "| features/ddp | 4 | green (shrunk) | 12 s | 8.1000 | 7.2000 |  |" in text
    assert "ValueError: a/b (torch)" in text
    assert "1 green, 0 stopped, 1 red, 0 timeout, 0 memory of 2" in text


def test_a_matrix_written_part_way_says_how_many_cases_are_left():
    results = [suite.Result("features", "ddp", 4, "green", 12.0, 8.1, 7.2, "", "", 1, 1.5, False, "cmd")]
    text = suite.render_markdown(results, {"target": "cpu", "date": "d", "machine": "m", "command": "c",
                                           "cases_planned": 3})
    assert "1 green, 0 stopped, 0 red, 0 timeout, 0 memory of 1 (2 of 3 cases not run yet)" in text


def test_a_checkouts_recipes_go_ahead_of_the_installed_ones(tmp_path):
    # The wheel's torchtitan_recipes.tests has no configs; a checkout's has (fsdp+cp names one).
    checkout, workdir = tmp_path / "torchtitan", tmp_path / "out"
    (checkout / "torchtitan_recipes" / "tests").mkdir(parents=True)
    (checkout / "torchtitan_recipes" / "__init__.py").write_text("")
    (checkout / "torchtitan_recipes" / "tests" / "__init__.py").write_text("def llama3_debugmodel_fsdp2_cp2(): ...\n")
    env = suite.with_checkout_recipes(str(checkout), str(workdir), {"PYTHONPATH": "/elsewhere"})
    probe = "import torchtitan_recipes.tests as t; print(t.__file__, hasattr(t, 'llama3_debugmodel_fsdp2_cp2'))"
    printed = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True,
                             text=True, check=True).stdout.split()
    assert os.path.realpath(printed[0]).startswith(str(checkout)) and printed[1] == "True"
    assert env["PYTHONPATH"].endswith(os.pathsep + "/elsewhere")
    assert suite.with_checkout_recipes(str(tmp_path / "copy-without-recipes"), str(workdir), {}) == {}


def test_a_shrunk_case_accumulates_as_many_microbatches_as_upstreams():
    # gpt_oss PP+SAC: global 64 at upstream's local 8; gradient_accumulation: local 8, global 32.
    shrunk = suite.shrink(["--training.global_batch_size", "64", "activation-checkpoint:selective"], 256, 2)
    assert shrunk == ["--training.global_batch_size", "16", "--training.seq_len", "256",
                      "--training.local_batch_size", "2", "activation-checkpoint:selective"]
    own = suite.shrink(["--training.local_batch_size", "8", "--training.global_batch_size", "32"], 256, 2)
    assert own[own.index("--training.global_batch_size") + 1] == "8" and own[-1] == "2"
    assert suite.shrink(["--parallelism.data_parallel_shard_degree", "2"], 128, 1)[-4:] == [
        "--training.seq_len", "128", "--training.local_batch_size", "1"]
    with pytest.raises(ValueError, match="whole number"):
        suite.shrink(["--training.global_batch_size", "36"], 256, 3)


def test_the_torchtitan_checkout_is_an_input_flag_or_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHTITAN_NPU", "cpu")
    monkeypatch.setenv("RUNNER_TEMP", str(tmp_path))  # restored afterwards: cmd_suite sets it
    monkeypatch.delenv("TORCHTITAN_SRC", raising=False)
    parser = argparse.ArgumentParser()
    suite.add_parser(parser.add_subparsers())
    assert suite.cmd_suite(parser.parse_args(["suite", "--output", str(tmp_path / "out")])) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--torchtitan-src" in line and "TORCHTITAN_SRC" in line and "torchtitan checkout (release/0.3)" in line
    # The variable stands in for the flag; a folder without upstream's case lists says so in one line.
    monkeypatch.setenv("TORCHTITAN_SRC", str(tmp_path))
    with pytest.raises(SystemExit, match=r"has no tests/integration_tests/features.py: give a torchtitan checkout"):
        suite.cmd_suite(parser.parse_args(["suite", "--run-train", _fake_run_train(tmp_path, ""),
                                           "--output", str(tmp_path / "out")]))


@needs_case_lists
def test_a_case_planned_not_to_fit_the_host_is_memory_without_starting(tmp_path, monkeypatch, capsys):
    """The rehearsal at upstream's shapes: a case npu-inject plan says would not fit is never started."""
    started = tmp_path / "started"
    run_train = _fake_run_train(tmp_path, f'touch {started}; echo "step:  1  loss:  8.1"\n')
    planned = {"need_bytes": 30 * 2**30, "asked_bytes": 39 * 2**30, "available_bytes": 20 * 2**30, "fits": False}
    monkeypatch.setattr(suite, "plan_host_memory", lambda case, args, workdir, env: (planned, ""))
    monkeypatch.setenv("TORCHTITAN_NPU", "cpu")
    output = tmp_path / "out"
    parser = argparse.ArgumentParser()
    suite.add_parser(parser.add_subparsers())
    args = parser.parse_args(["suite", "--torchtitan-src", TORCHTITAN_SRC, "--suite", "features", "--cases", "default",
                              "--run-train", run_train, "--output", str(output),
                              "--assets", os.path.join(REPO, "tests", "assets")])
    assert suite.cmd_suite(args) == 1
    (case,) = __import__("json").loads((output / "matrix.json").read_text())["cases"]
    assert case["status"] == "memory" and case["attributed_to"] == "host memory" and case["runs"] == 0
    assert "planned to need about 30.0 GiB" in case["cause"] and "(39.0 with the plan's margin)" in case["cause"]
    assert "20.0 GiB available" in case["cause"]
    assert case["planned_gib"] == 30.0 and not started.exists()
    # With --shrink (or --no-memory-check) nothing is planned and the case runs.
    monkeypatch.setattr(suite, "plan_host_memory", lambda *a: pytest.fail("planned a shrunk case"))
    args = parser.parse_args(["suite", "--torchtitan-src", TORCHTITAN_SRC, "--suite", "features", "--cases", "default",
                              "--run-train", run_train, "--output", str(tmp_path / "shrunk"), "--shrink", "256,2",
                              "--assets", os.path.join(REPO, "tests", "assets")])
    assert suite.cmd_suite(args) == 0 and started.exists()


def _torchtitan_metric_lines(caplog, color: bool) -> list[str]:
    """Training steps 1 and 2 (losses 8.1, 7.5) and a validation at step 2 (loss 6.25), as torchtitan 0.3.0's
    MetricsProcessor logs them (its own log and log_validation, on a stand-in for the processor's state)."""
    import logging
    import types

    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.tools import utils

    memory = types.SimpleNamespace(max_active_gib=1.0, max_active_pct=5.0, max_reserved_gib=1.2, max_reserved_pct=6.0,
                                   num_alloc_retries=0, num_ooms=0)
    processor = types.SimpleNamespace(
        num_flops_per_token=1000, time_last_log=0.0, ntokens_since_last_log=256, has_quantization=False,
        gpu_peak_flops=1e12, config=types.SimpleNamespace(log_freq=1),
        parallel_dims=types.SimpleNamespace(non_data_parallel_size=1),
        color=utils.Color() if color else utils.NoColor(),
        logger=types.SimpleNamespace(log=lambda metrics, step: None),
        device_memory_monitor=types.SimpleNamespace(get_peak_stats=lambda: memory, reset_peak_stats=lambda: None))
    with caplog.at_level(logging.INFO):
        for step, loss in ((1, 8.1), (2, 7.5)):
            processor.data_loading_times = [0.01]  # log() clears them
            MetricsProcessor.log(processor, step=step, global_avg_loss=loss, global_max_loss=loss, grad_norm=1.5)
        MetricsProcessor.log_validation(processor, loss=6.25, step=2)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3 and "validate step:  2" in lines[2] and "loss:  6.2500" in lines[2], lines
    return lines


@pytest.mark.parametrize("color", [True, False], ids=["color", "no_color"])
def test_a_validation_loss_is_not_taken_for_a_training_loss(tmp_path, caplog, color):
    lines = _torchtitan_metric_lines(caplog, color)
    output = "\n".join(f"[titan] 2026-11-29 03:04:03,794 - root - INFO - {line}" for line in lines)
    assert {int(step): float(loss) for step, loss in suite.LOSS_LINE.findall(output)} == {1: 8.1, 2: 7.5}
    # the project's other readers of those lines: the tests' runs, npu-inject compare, bench_compile
    from npu_inject.commands import compare
    from tools import bench_compile
    from tools.training_runs import parse_losses

    assert parse_losses(output) == {1: 8.1, 2: 7.5}
    (tmp_path / "train.log").write_text(output + "\n")
    assert compare.read_run(str(tmp_path / "train.log")).values["loss"] == {1: 8.1, 2: 7.5}
    assert [int(match.group(1)) for match in bench_compile.STEP_LINE.finditer(output)] == [1, 2]
    # the suite's verdict on a run that logs them: the last loss is step 2's training loss
    case = suite.Case("features", "demo", "demo", 1, [["--validator.enable"]], None)
    (tmp_path / "lines.txt").write_text(output + "\n")
    run_train = _fake_run_train(tmp_path, f"cat {tmp_path / 'lines.txt'}\n")
    result = suite.run_case(case, _args(tmp_path, run_train), str(tmp_path / "v"), dict(os.environ))
    assert (result.status, result.first_loss, result.last_loss) == ("green", 8.1, 7.5)
