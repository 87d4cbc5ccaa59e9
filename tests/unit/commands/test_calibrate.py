"""npu-inject calibrate on this CPU: a hardware file plan takes, every number sourced; bad input in one line."""

import json
import subprocess
import sys

import pytest
import torch

from npu_inject import hardware, kernel_bench
from npu_inject.commands import calibrate, cli


def _run(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "npu_inject", "calibrate", "--device", "cpu", "--ranks", "1",
                           "-o", str(tmp_path / "cpu.json"), *flags], capture_output=True, text=True, timeout=300)


def test_a_quick_calibration_writes_a_file_plan_takes_with_every_number_sourced(tmp_path):
    done = _run(tmp_path, "--quick")
    assert done.returncode == calibrate.EXIT_PARTIAL, done.stderr  # --quick: a smoke grid, marked partial
    assert "PARTIAL: --quick" in done.stdout
    document = json.loads((tmp_path / "cpu.json").read_text())
    rates = document["profiles"]["cpu"]["rates"]
    assert rates["partial"] is True
    # A busy host can time a case's backward at nothing: that kind is then left out and named, never guessed.
    if rates.get("missing"):
        assert f"PARTIAL: --quick; {', '.join(rates['missing'])} not measured" in done.stdout
    assert "matmul" not in rates.get("missing", [])
    points = [point for key in ("matmul", "attention", "memory", "fused") for point in rates.get(key, [])]
    assert points and all(point["source"].startswith("measured ") and " on cpu: " in point["source"] for point in points)
    profile = hardware.load(str(tmp_path / "cpu.json")).find("cpu")  # plan --hardware cpu takes this file's profile
    assert profile.rates is not None and profile.rates.matmul_tflops("fp32", 64, 64, 64) > 0
    assert profile.rates.host_us > 0 and profile.rates.kernel_us > 0


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "--budget must be above 0 seconds, got 0"),
    (["--dtypes", "bf17"], "--dtypes 'bf17': expected a comma list of bf16, fp16, fp32"),
    (["--threads", "0"], "--threads must be 1 or more, got 0"),
])
def test_bad_input_is_one_line_and_no_file(tmp_path, flags, message):
    done = _run(tmp_path, *flags)
    assert done.returncode == calibrate.EXIT_ERROR
    assert done.stderr.strip().splitlines() == [f"npu-inject calibrate: {message}"]
    assert not (tmp_path / "cpu.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_device_this_machine_lacks_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "npu_inject", "calibrate", "--device", "cuda", "-o",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == calibrate.EXIT_ERROR
    assert done.stderr.strip() == "npu-inject calibrate: --device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)"


def test_a_kernel_that_fails_leaves_a_partial_file_naming_what_is_missing(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise RuntimeError("the device refused this kernel\nsecond line")

    monkeypatch.setattr(kernel_bench, "attention", refuse)
    threads = torch.get_num_threads()
    args = cli.build_parser().parse_args(["calibrate", "--device", "cpu", "--quick", "--ranks", "1",
                                          "-o", str(tmp_path / "cpu.json")])
    try:
        assert args.run(args) == calibrate.EXIT_PARTIAL
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "attention: not measured: RuntimeError: the device refused this kernel" in out
    assert "second line" not in out
    rates = json.loads((tmp_path / "cpu.json").read_text())["profiles"]["cpu"]["rates"]
    assert rates["partial"] is True and rates["missing"] == ["attention"]
    assert "attention" not in rates


def test_grouped_points_on_an_accelerator_take_a_moe_layers_rows_within_its_weight_memory():
    gpu = kernel_bench.Device("cuda", "NVIDIA H200", "", torch.device("cpu"), 1)
    # qwen3_30b_a3b's layer gives 65,536 rows over 128 experts: 8 groups of 128 rows would fill a fraction of it.
    assert kernel_bench.grouped_count(gpu, 128, 1024, 1024, 2) == 128
    assert kernel_bench.grouped_count(gpu, 4096, 1024, 1024, 2) == 16
    # 16384 x 16384 bf16 weights are 512 MiB a group: 8 of them, not 128.
    assert kernel_bench.grouped_count(gpu, 128, 16384, 16384, 2) == 8
    cpu = kernel_bench.Device("cpu", "cpu: test", "", torch.device("cpu"), 1)
    assert kernel_bench.grouped_count(cpu, 64, 1024, 1024, 4) == 8
