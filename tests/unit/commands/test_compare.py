"""npu-inject compare: reading runs (logs, JSONL, TensorBoard, dump folders), alignment, exit codes, plot.

Expected differences are written out by hand from the numbers in the fixtures, not recomputed
with the module's own function.
"""

from __future__ import annotations

import json
import sys

import pytest

from npu_inject.commands import cli, compare
from testkit import clean_env, run_python

COLOUR = "\x1b[31m"
RESET = "\x1b[39m"


def metric_line(step: int, loss: float, grad_norm: float, prefix: str = "", colour: bool = False) -> str:
    """A line as torchtitan 0.3.0's MetricsProcessor.log prints it (colours optional)."""
    c, r = (COLOUR, RESET) if colour else ("", "")
    return (f"{prefix}[titan] 2026-11-22 22:28:22,566 - root - INFO - {c}step: {step:2}  {c}loss: {loss:8.5f}  "
            f"{c}grad_norm: {grad_norm:7.4f}  {c}memory:  1.25GiB(5.30%)  {c}tps: 42  {c}tflops: 0.00  "
            f"{c}mfu: 0.00%{r}\n")


def write_log(path, rows, **kw) -> str:
    path.write_text("".join(metric_line(step, loss, grad, **kw) for step, loss, grad in rows))
    return str(path)


REFERENCE = [(1, 8.0, 2.0), (2, 7.5, 1.5), (3, 7.0, 1.25), (4, 6.5, 1.0)]


def test_log_with_colours_rank_prefixes_and_validation_lines(tmp_path):
    text = "[rank0]:[titan] ... - INFO - torchtitan version: 0.3.0\n"
    for step, loss, grad in REFERENCE:
        text += metric_line(step, loss, grad, prefix="[rank0]:", colour=True)
        text += metric_line(step, loss + 1, grad + 1, prefix="[rank1]:", colour=True)
    text += "[rank0]:[titan] - INFO - \x1b[33mvalidate step:  4  \x1b[32mloss:  9.9999  memory: 1GiB\n"
    (tmp_path / "run.log").write_text(text)
    run = compare.read_run(str(tmp_path / "run.log"))
    assert run.values["loss"] == {1: 8.0, 2: 7.5, 3: 7.0, 4: 6.5}
    assert run.values["grad_norm"] == {1: 2.0, 2: 1.5, 3: 1.25, 4: 1.0}
    assert any("read rank 0 of ranks 0, 1" in note for note in run.notes)
    assert compare.read_run(str(tmp_path / "run.log"), rank=1).values["loss"] == {1: 9.0, 2: 8.5, 3: 8.0, 4: 7.5}
    with pytest.raises(compare.RunInputError, match=r"run.log: --rank 5: .*ranks present: 0, 1"):
        compare.read_run(str(tmp_path / "run.log"), rank=5)


def test_log_duplicates_equal_are_merged_and_conflicts_are_noted(tmp_path):
    # Two unprefixed ranks print the same global values; then a restart re-logs steps 3-4 differently.
    rows = [r for r in REFERENCE for _ in range(2)] + [(3, 7.1, 1.25), (4, 6.6, 1.0)]
    run = compare.read_run(write_log(tmp_path / "run.log", rows))
    assert run.values["loss"] == {1: 8.0, 2: 7.5, 3: 7.1, 4: 6.6}
    assert [n for n in run.notes if "loss logged with different values at 2 step(s) (3-4)" in n]
    assert not [n for n in run.notes if "grad_norm" in n]


def test_jsonl_flat_and_structured_trace_records(tmp_path):
    flat = tmp_path / "flat.jsonl"
    flat.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss_metrics/global_avg_loss": 8.0, "grad_norm": 2.0, "tflops": 1.0},
        {"step": 2, "loss": 7.5},
        {"note": "no step here"},
        {},
    ]) + "\n\n")
    run = compare.read_run(str(flat))
    assert run.values == {"loss": {1: 8.0, 2: 7.5}, "grad_norm": {1: 2.0}}

    trace = tmp_path / "training.global_rank_0.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"rank": 0, "step": 1, "log_type_name": "metric_value", "event_name": "local_valid_tokens", "value": 512.0},
        {"rank": 0, "step": 1, "log_type_name": "metric_value", "event_name": "train.loss", "value": 8.0},
        {"rank": 0, "step": 1, "log_type_name": "metric_value", "event_name": "grad_norm", "value": 2.0},
        {"rank": 0, "log_type_name": "training_start", "event_name": None},
    ]) + "\n")
    assert compare.read_run(str(trace)).values == {"loss": {1: 8.0}, "grad_norm": {1: 2.0}}

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 8.0}\n{"step": 2, loss}\n')
    with pytest.raises(compare.RunInputError, match=r"bad.jsonl:2: not JSON"):
        compare.read_run(str(bad))


def test_tensorboard_event_file(tmp_path):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp_path / "tb" / "20261122-2228"))
    for step, loss, grad in REFERENCE:
        for tag, value in (("loss_metrics/global_avg_loss", loss), ("grad_norm", grad), ("tflops", 3.0)):
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(event_pb2.Event(step=step, wall_time=1.0, summary=summary))
    writer.close()
    run = compare.read_run(str(tmp_path))  # a dump folder: the event file is found inside tb/
    assert run.source.startswith("tensorboard ") and "tfevents" in run.source
    assert run.values == {"loss": dict((s, l) for s, l, _ in REFERENCE), "grad_norm": dict((s, g) for s, _, g in REFERENCE)}


def test_dump_folders_without_metrics_or_with_several_sources(tmp_path):
    dump = tmp_path / "dump"
    (dump / "structured_logs").mkdir(parents=True)
    # What torchtitan 0.3.0 writes by default: token counts, no loss.
    (dump / "structured_logs" / "training.global_rank_0.x.jsonl").write_text(
        json.dumps({"step": 1, "event_name": "local_valid_tokens", "value": 512.0}) + "\n")
    (dump / "npu_inject").mkdir()
    (dump / "npu_inject" / "notes.txt").write_text("nothing\n")
    with pytest.raises(compare.RunInputError) as error:
        compare.read_run(str(dump))
    message = str(error.value)
    assert message.startswith(f"{dump}: no training metrics in this folder")
    assert "structured_logs/training.global_rank_0.x.jsonl" in message and "--metrics.enable_tensorboard" in message

    write_log(dump / "train.log", REFERENCE)
    assert compare.read_run(str(dump)).source == f"log {dump / 'train.log'}"
    write_log(dump / "again.out", REFERENCE)
    with pytest.raises(compare.RunInputError, match="several log files hold training metrics"):
        compare.read_run(str(dump))

    with pytest.raises(compare.RunInputError, match=r"missing.log: no such file or folder"):
        compare.read_run(str(tmp_path / "missing.log"))
    (tmp_path / "empty.log").write_text("[titan] INFO - nothing to see\n")
    with pytest.raises(compare.RunInputError, match=r"empty.log: no training metrics found in this log file"):
        compare.read_run(str(tmp_path / "empty.log"))


@pytest.mark.parametrize("a, b, expected", [
    (8.0, 8.08, 0.01),
    (-2.0, -1.0, 0.5),
    (2.0, 2.0, 0.0),
    (0.0, 0.0, 0.0),
    (0.0, 1e-9, float("inf")),
    (float("nan"), float("nan"), 0.0),
    (float("inf"), float("inf"), 0.0),
    (1.0, float("nan"), float("inf")),
    (float("inf"), 1.0, float("inf")),
])
def test_relative_difference(a, b, expected):
    assert compare.relative_difference(a, b) == pytest.approx(expected, rel=1e-12)


def test_exit_codes_table_and_first_diverging_step(tmp_path, capsys):
    a = write_log(tmp_path / "a.log", REFERENCE)
    same = write_log(tmp_path / "same.log", REFERENCE)
    assert cli.main(["compare", a, same]) == 0
    out = capsys.readouterr().out
    assert "OK: every compared step within tolerance 0.01" in out
    assert "loss           4          0.00e+00 (1)   0.00e+00  -" in out

    # loss at step 3: 7.0 -> 7.14 (2% off); grad norm at step 4: 1.0 -> 1.005 (0.5%); step 5 only in B.
    perturbed = write_log(tmp_path / "b.log", REFERENCE[:2] + [(3, 7.14, 1.25), (4, 6.5, 1.005), (5, 6.0, 1.0)])
    assert cli.main(["compare", a, perturbed]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED: first step past tolerance 0.01: step 3 (loss 7 -> 7.14, rel 2.00e-02)" in out
    assert "loss           4          2.00e-02 (3)   5.00e-03  3" in out
    assert "grad_norm      4          5.00e-03 (4)   1.25e-03  -" in out
    assert "INCOMPLETE: loss: steps only in B: 5 (1 steps): run A ends at step 4, run B at step 5" in out
    row = next(line for line in out.splitlines() if line.startswith("     3 "))
    assert row.split()[:4] == ["3", "7", "7.14", "2.00e-02*"]

    # Within tolerance, but step 5 is in B only: compared as a prefix when asked to.
    assert cli.main(["compare", a, perturbed, "--tolerance", "0.03"]) == 1
    assert cli.main(["compare", a, perturbed, "--tolerance", "0.03", "--allow-prefix"]) == 0
    assert cli.main(["compare", a, perturbed, "--tolerance", "0.001", "--metrics", "grad_norm"]) == 1
    assert "step 4 (grad_norm 1 -> 1.005, rel 5.00e-03)" in capsys.readouterr().out


TEN_STEPS = [(step, 10.0 - step / 4, 2.0 - step / 10) for step in range(1, 11)]


def test_a_run_that_stopped_early_fails_naming_the_missing_steps(tmp_path, capsys):
    # A crashed NPU run holds the reference's first 2 steps, both equal to it.
    a = write_log(tmp_path / "a.log", TEN_STEPS)
    crashed = write_log(tmp_path / "b.log", TEN_STEPS[:2])
    assert cli.main(["compare", a, crashed]) == 1
    out = capsys.readouterr().out
    assert "OK" not in out
    for metric in ("loss", "grad_norm"):
        assert (f"INCOMPLETE: {metric}: steps only in A: 3-10 (8 steps): run B ends at step 2, run A at step 10 "
                "(run B stopped early") in out
    # The reference shorter than B: the same failure, the other way round.
    assert cli.main(["compare", crashed, a]) == 1
    assert "INCOMPLETE: loss: steps only in B: 3-10 (8 steps): run A ends at step 2" in capsys.readouterr().out


def test_allow_prefix_compares_the_steps_of_the_shorter_run_and_says_so(tmp_path, capsys):
    a = write_log(tmp_path / "a.log", TEN_STEPS)
    crashed = write_log(tmp_path / "b.log", TEN_STEPS[:2])
    assert cli.main(["compare", a, crashed, "--allow-prefix"]) == 0
    out = capsys.readouterr().out
    assert ("OK: every compared step within tolerance 0.01; 2 steps compared (1-2), a prefix comparison "
            "(--allow-prefix): 8 later step(s) of the longer run not compared") in out
    assert "note: loss: steps only in A, not compared (--allow-prefix): 3-10 (8 steps)" in out
    assert "INCOMPLETE" not in out
    # A step missing inside the compared prefix is not a prefix: it still fails.
    gap = write_log(tmp_path / "gap.log", TEN_STEPS[:1] + TEN_STEPS[2:4])
    assert cli.main(["compare", a, gap, "--allow-prefix"]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE: loss: steps only in A: 2 (1 steps), missing from run B although it goes on to step 4" in out
    assert "OK" not in out


def test_a_metric_missing_from_one_run_fails_naming_it(tmp_path, capsys):
    a = write_log(tmp_path / "a.log", REFERENCE)
    loss_only = tmp_path / "b.jsonl"
    loss_only.write_text("".join(json.dumps({"step": step, "loss": loss}) + "\n" for step, loss, _ in REFERENCE))
    for extra in ([], ["--allow-prefix"]):
        assert cli.main(["compare", a, str(loss_only), *extra]) == 1
        out = capsys.readouterr().out
        assert "INCOMPLETE: grad_norm: not compared, run B has no grad_norm values (--metrics loss leaves it out)" in out
        assert "OK" not in out
    assert cli.main(["compare", a, str(loss_only), "--metrics", "loss"]) == 0
    assert "OK: every compared step within tolerance 0.01; 4 steps compared (1-4)" in capsys.readouterr().out


def test_bad_input_exits_2_naming_the_path(tmp_path, capsys):
    a = write_log(tmp_path / "a.log", REFERENCE)
    assert cli.main(["compare", a, str(tmp_path / "nope")]) == 2
    assert f"npu-inject: error: {tmp_path / 'nope'}: no such file or folder" in capsys.readouterr().err
    assert cli.main(["compare", a, a, "--metrics", "loss,lr"]) == 2
    assert "valid names are loss, grad_norm" in capsys.readouterr().err
    disjoint = write_log(tmp_path / "late.log", [(10, 1.0, 1.0)])
    assert cli.main(["compare", a, disjoint]) == 2
    assert "nothing to compare: loss: not compared, no step in common (A: 1-4, B: 10)" in capsys.readouterr().err


def test_long_runs_print_an_abridged_table(tmp_path, capsys):
    rows = [(step, 10.0 - step / 100, 1.0) for step in range(1, 101)]
    a = write_log(tmp_path / "a.log", rows)
    rows[49] = (50, rows[49][1] * 1.5, 1.0)
    b = write_log(tmp_path / "b.log", rows)
    assert cli.main(["compare", a, b]) == 1
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()
    steps = [line.split()[0] for line in table[1:]]
    assert steps == ["1", "2", "3", "4", "5", "...", "49", "50", "51", "52", "...", "96", "97", "98", "99", "100"]
    assert cli.main(["compare", a, b, "--all-steps"]) == 1
    assert len(capsys.readouterr().out.split("\n\n")[1].splitlines()) == 101


def test_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = write_log(tmp_path / "a.log", REFERENCE)
    b = write_log(tmp_path / "b.log", REFERENCE[:2] + [(3, 7.14, 1.25), (4, 0.0, float("nan"))])
    png = tmp_path / "out.png"
    assert cli.main(["compare", a, b, "--plot", str(png)]) == 1
    assert f"plot: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    a = write_log(tmp_path / "a.log", REFERENCE)
    assert cli.main(["compare", a, a, "--plot", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err == "npu-inject: error: --plot needs matplotlib: pip install 'matplotlib' (npu-inject's plot extra)\n"
    assert not (tmp_path / "out.png").exists()


def test_help_states_the_relative_difference(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "relative difference at a step = |B - A| / |A|, RUN_A being the reference" in help_text
    assert "a step or metric present in one run only (a run that crashed or was stopped early) fails" in help_text
    assert "--allow-prefix compare the runs up to the last step of the shorter one" in help_text


def test_compare_imports_neither_torch_nor_plotting_nor_tensorboard(tmp_path):
    a = write_log(tmp_path / "a.log", REFERENCE)
    result = run_python(f"""
        import sys
        from npu_inject.commands import cli
        code = cli.main(["compare", {a!r}, {a!r}])
        print("exit", code, sorted(m for m in ("torch", "torchtitan", "matplotlib", "tensorboard") if m in sys.modules))
    """, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "exit 0 []"
