"""metrics, determinism, profiling and the HCCL flight recorder: what each sets, per target.

Each patch is applied through a PatchContext for the target under test (no torch_npu is
imported: none of these paths needs it at apply time) and reverted afterwards. Expected
values come from torchtitan itself where it has them: the HCCL flight-recorder variables
must carry what upstream's ``init_distributed`` writes into NCCL's, and upstream's
``set_determinism`` is what writes the cuBLAS variable the NPU target must not keep.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import types

import pytest
import torch

from npu_inject import module_facts
from npu_inject import registry as registry_mod
from npu_inject.patching import PatchContext


def _apply(patch_id: str, target: str, **options) -> tuple[types.ModuleType, PatchContext]:
    spec = registry_mod.load(None).get(patch_id)
    module = importlib.import_module(spec.module)
    ctx = PatchContext(patch_id, target, {**spec.options, **options},
                       declared_targets=module_facts.declared_names(module))
    module.apply(ctx)
    return module, ctx


@pytest.fixture
def applied():
    contexts = []

    def apply(patch_id, target, **options):
        module, ctx = _apply(patch_id, target, **options)
        contexts.append(ctx)
        return module, ctx

    yield apply
    for ctx in reversed(contexts):
        ctx.restore()


# -- metrics ------------------------------------------------------------------------------------

# CANN's platform configurations (hicann/runtime src/platform/platform_config/cann/<SoC>.ini):
# cube_core_cnt and cube_freq (MHz); a Da Vinci cube does 16x16x16 BF16 multiply-adds a cycle.
CANN_INI_CUBE = {"Ascend910B1": (24, 1850), "Ascend910B2": (24, 1800), "Ascend910B3": (20, 1800),
                 "Ascend910B4": (20, 1500), "Ascend910_9392": (24, 1850), "Ascend910_9382": (24, 1800),
                 "Ascend910_9372": (20, 1800), "Ascend910_9362": (20, 1500)}


@pytest.mark.parametrize("device_name", sorted(CANN_INI_CUBE))
def test_ascend_peaks_are_the_cube_figures_of_cann_configuration(applied, device_name):
    applied("metrics", "npu")
    from torchtitan.tools import utils

    cores, mhz = CANN_INI_CUBE[device_name]
    assert utils.get_peak_flops(device_name) == pytest.approx(cores * mhz * 1e6 * 16 * 16 * 16 * 2, rel=1e-4)


def test_variant_names_take_their_part_and_unknown_parts_get_no_mfu(applied):
    _, ctx = applied("metrics", "npu")
    from torchtitan.tools import utils

    assert utils.get_peak_flops("Ascend910B2C") == pytest.approx(24 * 1800e6 * 8192, rel=1e-4)
    assert math.isnan(utils.get_peak_flops("Ascend310P3")), "no profile: NaN, not A100's 312T"
    assert ctx.fallbacks and "Ascend310P3" in ctx.fallbacks[0] and "peak_tflops" in ctx.fallbacks[0]


def test_option_overrides_the_table(applied):
    applied("metrics", "npu", peak_tflops=400.0)
    from torchtitan.tools import utils

    assert utils.get_peak_flops("Ascend310P3") == pytest.approx(400e12)


CPU_DEVICE = "CPU rehearsal (host memory: process RSS)"


def test_rehearsal_mfu_is_against_the_hosts_measured_matmul_peak_without_an_agreement(applied, monkeypatch, tmp_path):
    """get_peak_flops called outside a Trainer (no rank agreement): this process's own measurement, said so."""
    from torchtitan.tools import utils

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # this host's figure from this test's probe alone

    upstream = utils.get_peak_flops(CPU_DEVICE)
    assert upstream == 312e12  # what torchtitan would divide by: A100's peak
    from npu_inject import host_peak

    host_peak.measured_host_peak_flops.cache_clear()
    rng_before = torch.get_rng_state()
    _, ctx = applied("metrics", "cpu")  # measures rank 0's proposal as it applies
    peak = utils.get_peak_flops(CPU_DEVICE)
    # The probe may run after torchtitan seeded the job: it must not move the random stream (weights, data).
    assert torch.equal(torch.get_rng_state(), rng_before)
    # Independent of the patch's probe: one timed float32 matmul of another shape on this host.
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    torch.mm(a, b)
    started = time.perf_counter()
    torch.mm(a, b)
    float32_rate = 2 * 384**3 / (time.perf_counter() - started)
    assert math.isfinite(peak) and peak > 0.2 * float32_rate, (peak, float32_rate)
    (fallback,) = ctx.fallbacks
    assert fallback.startswith("MFU against this process's own host matmul peak") and "GFLOP/s" in fallback
    assert "before the ranks agreed" in fallback
    applied("metrics", "cpu", peak_tflops=2.0)
    assert utils.get_peak_flops(CPU_DEVICE) == pytest.approx(2e12)


def test_every_rank_divides_by_rank0s_measured_peak(applied, monkeypatch):
    """Issue 43: each rank divided by its own measurement (27% and 46% MFU for one step); now rank 0's, on all."""
    from npu_inject.patches import metrics

    this_rank = (4.6e10, "host matmul peak 46.0 GFLOP/s measured in float32 (512x512x512, best of 5, 1 thread(s))")
    rank0 = (2.7e10, "host matmul peak 27.0 GFLOP/s measured in float32 (512x512x512, best of 5, 1 thread(s))")
    monkeypatch.setattr(metrics, "measured_host_peak_flops", lambda: this_rank)
    monkeypatch.delenv("TORCHTITAN_NPU_HARDWARE", raising=False)
    _, ctx = applied("metrics", "cpu")
    ((name, proposal, use),) = ctx.agreements
    assert (name, proposal) == ("host_peak", this_rank)
    use(rank0)  # what the runtime's rank agreement hands every rank when the process group starts
    from torchtitan.tools import utils

    assert utils.get_peak_flops(CPU_DEVICE) == 2.7e10
    assert ctx.notes == ["MFU in the CPU rehearsal is against the host matmul peak 27.0 GFLOP/s measured in "
                         "float32 (512x512x512, best of 5, 1 thread(s)): rank 0's measurement, the same on every rank"]
    assert not ctx.fallbacks


def test_only_rank0_measures_the_host_peak(applied, monkeypatch):
    """Every rank probed at once, sharing rank 0's cores: rank 0's figure then moved with the other ranks."""
    from npu_inject.patches import metrics

    def no_probe():
        raise AssertionError("only rank 0's measurement is used: another rank must not probe")

    monkeypatch.setattr(metrics, "measured_host_peak_flops", no_probe)
    monkeypatch.delenv("TORCHTITAN_NPU_HARDWARE", raising=False)
    monkeypatch.setenv("RANK", "1")
    _, ctx = applied("metrics", "cpu")
    ((name, proposal, use),) = ctx.agreements
    assert (name, proposal) == ("host_peak", None)
    use((2.7e10, "host matmul peak 27.0 GFLOP/s measured in float32 (rank 0's)"))
    from torchtitan.tools import utils

    assert utils.get_peak_flops(CPU_DEVICE) == 2.7e10


def test_the_host_probe_measures_past_a_slow_start_and_interrupted_matmuls(monkeypatch, tmp_path):
    """A stand-in matmul with the host's habits: 2 ms each for the first 20 ms of a dtype (its vector units
    powering up), then 0.2 ms, every fifth one interrupted (2 ms). The probe's figure is the full-speed one:
    2 x 512^3 FLOP in 0.2 ms is 1342 GFLOP/s. (The old probe, one untimed matmul and the best of five,
    measured 134.)"""
    from npu_inject import host_peak

    calls: dict[torch.dtype, list[float]] = {}  # when each call of a dtype began

    def matmul(a, b):
        now = time.perf_counter()
        began = calls.setdefault(a.dtype, [])
        began.append(now)
        cold = now - began[0] < 0.02 or len(began) % 5 == 0
        until = now + (0.002 if cold else 0.0002)
        while time.perf_counter() < until:  # busy: a sleep may overshoot by more than the matmul lasts
            pass

    monkeypatch.setattr(torch, "mm", matmul)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no figure kept from a real probe
    host_peak.measured_host_peak_flops.cache_clear()
    try:
        rate, how = host_peak.measured_host_peak_flops()
    finally:
        host_peak.measured_host_peak_flops.cache_clear()
    # never faster than the stand-in's 0.2 ms; within 10% of it (the timer's and a busy host's own overhead)
    assert 0.9 * 1342e9 <= rate <= 1342e9 * 1.0001, (rate, how)
    assert "after 0.05 s of warm-up" in how, how


def test_the_best_figure_measured_on_a_host_is_kept_and_a_slower_one_never_lowers_it(monkeypatch, tmp_path):
    """A loaded host ran every matmul at 0.4x for longer than the probe (446-450 GFLOP/s against 1060-1130 on
    the same host): such a run divides by the best figure kept for the host, and says what it measured."""
    from npu_inject import host_peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "npu_inject" / "host_peak.json"
    one_thread, two_threads = "Xeon (flags 0), torch 2.14.1, 1 thread(s)", "Xeon (flags 0), torch 2.14.1, 2 thread(s)"
    assert host_peak.remembered(one_thread, 1.06e12, "A") == (1.06e12, f"1060.0 GFLOP/s measured in A; kept in {path}")
    assert host_peak.remembered(one_thread, 4.5e11, "B") == (
        1.06e12, f"1060.0 GFLOP/s, the best measured for this host (A; kept in {path}); this process measured "
                 "450.0 GFLOP/s")
    assert host_peak.remembered(two_threads, 2.0e12, "C")[0] == 2.0e12  # another key: its own figure
    assert host_peak.remembered(one_thread, 1.13e12, "D")[0] == 1.13e12  # a faster one replaces it
    assert json.loads(path.read_text()) == {one_thread: {"flops": 1.13e12, "how": "D"},
                                            two_threads: {"flops": 2.0e12, "how": "C"}}
    path.write_text("{")
    rate, how = host_peak.remembered(one_thread, 4.5e11, "E")
    assert (rate, how.split("; ")[0]) == (4.5e11, "450.0 GFLOP/s measured in E"), how
    assert f"; {path} could not be read (JSONDecodeError: " in how and how.endswith(f"; kept in {path}"), how
    assert json.loads(path.read_text()) == {one_thread: {"flops": 4.5e11, "how": "E"}}
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))  # a file where the folder would go
    rate, how = host_peak.remembered(one_thread, 4.6e11, "F")
    assert rate == 4.6e11 and how.startswith("460.0 GFLOP/s measured in F; "), how
    assert how.endswith(f"; not kept: {path}/npu_inject/host_peak.json: Not a directory"), how


def test_a_calibrated_cpu_profile_gives_the_rehearsals_peak(applied, monkeypatch, tmp_path):
    from npu_inject import hardware
    from npu_inject.patches import metrics

    def no_probe():
        raise AssertionError("a calibrated cpu profile needs no measurement")

    monkeypatch.setattr(metrics, "measured_host_peak_flops", no_probe)
    document = json.load(open(hardware.PACKAGED))
    profile = dict(document["profiles"]["Ascend910B1"], family="cpu", description="this host, calibrated")
    profile.pop("rates")
    profile["peak_tflops"] = {"bf16": {"value": 0.031, "source": "npu-inject calibrate: the best matmul of the grid"},
                              "fp32": {"value": 0.052, "source": "npu-inject calibrate: the best matmul of the grid"}}
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"profiles": {"cpu": profile}}))
    monkeypatch.setenv("TORCHTITAN_NPU_HARDWARE", str(path))
    _, ctx = applied("metrics", "cpu")
    assert ctx.agreements == []  # every rank reads the same file
    from torchtitan.tools import utils

    assert utils.get_peak_flops(CPU_DEVICE) == pytest.approx(0.052e12)
    assert ctx.notes == [f"MFU in the CPU rehearsal is against the calibrated cpu profile's fp32 matmul peak 52.0 "
                         f"GFLOP/s ({path}: npu-inject calibrate: the best matmul of the grid), the same on every rank"]


def test_an_unreadable_hardware_file_falls_back_to_rank0s_peak_and_says_so(applied, monkeypatch, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{")
    monkeypatch.setenv("TORCHTITAN_NPU_HARDWARE", str(path))
    _, ctx = applied("metrics", "cpu")
    (fallback,) = ctx.fallbacks
    assert str(path) in fallback and fallback.endswith("MFU against rank 0's measured host peak instead")
    assert [name for name, _, _ in ctx.agreements] == ["host_peak"]


# -- determinism ------------------------------------------------------------------------------

def _trainer(deterministic: bool):
    return types.SimpleNamespace(config=types.SimpleNamespace(debug=types.SimpleNamespace(deterministic=deterministic)))


def test_hccl_determinism_is_set_before_the_process_group(applied, monkeypatch):
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    seen = {}
    monkeypatch.setattr("torchtitan.trainer.Trainer.init_distributed",
                        lambda self: seen.setdefault("at_init", os.environ.get("HCCL_DETERMINISTIC")))
    from torchtitan.trainer import Trainer

    _, ctx = applied("determinism", "npu")
    Trainer.init_distributed(_trainer(False))
    assert seen.pop("at_init") is None
    Trainer.init_distributed(_trainer(True))
    assert seen["at_init"] == "true"
    assert "set HCCL_DETERMINISTIC=true (deterministic HCCL reductions)" in ctx.notes


def test_user_hccl_determinism_is_kept(applied, monkeypatch):
    monkeypatch.setenv("HCCL_DETERMINISTIC", "strict")
    monkeypatch.setattr("torchtitan.trainer.Trainer.init_distributed", lambda self: None)
    from torchtitan.trainer import Trainer

    applied("determinism", "npu")
    Trainer.init_distributed(_trainer(True))
    assert os.environ["HCCL_DETERMINISTIC"] == "strict"


@pytest.fixture
def restore_determinism_state(monkeypatch):
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, FlexAttention.__dict__["_compiled_flex_attn"],
             dict(FlexAttention.inductor_configs), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    rng = torch.get_rng_state()
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]
    FlexAttention._compiled_flex_attn = saved[3]
    FlexAttention.inductor_configs.clear()
    FlexAttention.inductor_configs.update(saved[4])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[5], saved[6]
    torch.set_rng_state(rng)


def _run_set_determinism():
    from torchtitan.config import DebugConfig
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_determinism(types.SimpleNamespace(world_size=1), torch.device("cpu"),
                               DebugConfig(deterministic=True, seed=3), distinct_seed_mesh_dims=["pp"])


def test_upstream_determinism_sets_cuda_variables(restore_determinism_state):
    _run_set_determinism()  # no patch: what the NPU target must not inherit
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    assert torch.backends.cudnn.deterministic is True


def test_npu_determinism_keeps_deterministic_kernels_without_cuda_settings(applied, restore_determinism_state):
    cudnn_before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    _, ctx = applied("determinism", "npu")
    _run_set_determinism()
    assert torch.are_deterministic_algorithms_enabled(), "torch_npu reads this flag for ACL_OP_DETERMINISTIC"
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == cudnn_before
    assert any("passes to ACL_OP_DETERMINISTIC" in note for note in ctx.notes)


def test_rehearsal_determinism_sets_no_hccl_or_cuda_variables(applied, restore_determinism_state, monkeypatch):
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    monkeypatch.setattr("torchtitan.trainer.Trainer.init_distributed", lambda self: None)
    from torchtitan.trainer import Trainer

    applied("determinism", "cpu")
    Trainer.init_distributed(_trainer(True))
    _run_set_determinism()
    assert "HCCL_DETERMINISTIC" not in os.environ and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.are_deterministic_algorithms_enabled()


# -- HCCL flight recorder (collectives) ---------------------------------------------------------

FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_HCCL_TRACE_BUFFER_SIZE",
                             "TORCH_HCCL_DUMP_ON_TIMEOUT", "TORCH_HCCL_ENABLE_MONITORING",
                             "TORCH_HCCL_DEBUG_INFO_TEMP_FILE", "HCCL_CONNECT_TIMEOUT", "HCCL_ASYNC_ERROR_HANDLING")


def _init_distributed(monkeypatch, tmp_path, **comm):
    """torchtitan's init_distributed up to (not including) creating the process group."""
    from torchtitan.config.configs import CommConfig
    from torchtitan.distributed import utils as dist_utils

    for name in FLIGHT_RECORDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    dist_utils.init_distributed(CommConfig(**comm), base_folder=str(tmp_path))
    return {name: os.environ.get(name) for name in FLIGHT_RECORDER_VARIABLES}


@pytest.mark.parametrize("trace_buf_size", [20000, 0])
def test_hccl_flight_recorder_carries_what_torchtitan_gives_nccl(applied, monkeypatch, tmp_path, trace_buf_size):
    applied("collectives", "npu")
    env = _init_distributed(monkeypatch, tmp_path, trace_buf_size=trace_buf_size,
                            save_traces_folder="traces", save_traces_file_prefix="r_")
    assert env["TORCH_HCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"] == str(trace_buf_size)
    assert env["TORCH_HCCL_DUMP_ON_TIMEOUT"] == env["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    assert env["TORCH_HCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"]
    if trace_buf_size:
        assert env["TORCH_HCCL_DEBUG_INFO_TEMP_FILE"] == os.path.join(str(tmp_path), "traces", "r_")
        assert env["TORCH_HCCL_ENABLE_MONITORING"] == "1"
        assert os.path.isdir(tmp_path / "traces")
    else:
        assert env["TORCH_HCCL_DUMP_ON_TIMEOUT"] is None and env["TORCH_HCCL_ENABLE_MONITORING"] is None


def test_user_flight_recorder_settings_are_kept(applied, monkeypatch, tmp_path):
    applied("collectives", "npu")
    monkeypatch.setenv("TORCH_HCCL_ENABLE_MONITORING", "0")
    from torchtitan.config.configs import CommConfig
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    dist_utils.init_distributed(CommConfig(), base_folder=str(tmp_path))
    assert os.environ["TORCH_HCCL_ENABLE_MONITORING"] == "0"


# -- profiling -------------------------------------------------------------------------------------

def test_npu_profiler_schedule_is_torchtitans():
    from npu_inject.patches.profiling import npu_schedule_arguments
    from torchtitan.tools.profiler import Profiler

    config = Profiler.Config(profile_freq=10, profiler_warmup=3, profiler_active=2, profiler_repeat=4)
    assert npu_schedule_arguments(config) == {"wait": 5, "warmup": 3, "active": 2, "repeat": 4}
    with pytest.raises(ValueError, match=r"profile_freq \(3\) must be >= profiler_warmup \(3\) \+ profiler_active \(1\)"):
        npu_schedule_arguments(Profiler.Config(profile_freq=3, profiler_warmup=3, profiler_active=1))


def test_rehearsal_memory_snapshot_is_one_clear_note(applied, tmp_path, monkeypatch):
    _, ctx = applied("profiling", "cpu")
    from torchtitan.tools.profiler import Profiler

    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    profiler = Profiler.Config(enable_memory_snapshot=True, profile_freq=1).build(base_folder=str(tmp_path))
    with profiler as active:
        active.step()
        assert active.memory_profiler is None
    assert [note for note in ctx.notes if "enable-memory-snapshot" in note] == [
        "--profiler.enable-memory-snapshot: no snapshot in the CPU rehearsal (memory history is recorded by a "
        "device caching allocator, torch.npu's on the NPU target; the host has none)"
    ]


NPU_PROFILER_PROGRAM = r"""
import json, os, pickle, sys
import torch, torch_npu
from npu_inject import module_facts, registry
from npu_inject.patching import PatchContext
import npu_inject.patches.profiling as profiling
spec = registry.load(None).get("profiling")
ctx = PatchContext("profiling", "npu", dict(spec.options), declared_targets=module_facts.declared_names(profiling))
profiling.apply(ctx)
from torchtitan.tools import profiler as titan_profiler
titan_profiler.device_module = torch.npu  # what the device patch gives torchtitan on the NPU target
torch.distributed.get_rank = lambda: 0
config = titan_profiler.Profiler.Config(enable_profiling=True, profile_freq=2, profiler_warmup=0, profiler_active=1,
                                        enable_memory_snapshot=True, memory_snapshot_freq=2)
folder = sys.argv[1]
with config.build(base_folder=folder) as profiler:
    for _ in range(2):
        (torch.ones(64, 64, device="npu") @ torch.ones(64, 64, device="npu")).sum().item()
        profiler.step()
print("pid", os.getpid())
snapshot = pickle.load(open(os.path.join(folder, "profiling/memory_snapshot/step_000000000002/000000_step_2.pickle"), "rb"))
print("snapshot", json.dumps(snapshot, default=repr))
print("notes", ctx.notes)
"""


def test_npu_profiler_and_memory_snapshot_on_the_simulated_npu(tmp_path):
    """The NPU branch on the stand-in: the trace folder and the snapshot are what the real torch_npu
    writes, as read from its wheel (tests/support/torch_npu_source.py); the names the branch calls are
    checked against the wheel by tests/contract/test_torch_npu_contract.py."""
    import json
    import subprocess
    import sys

    import torch_npu_source
    from testkit import REPO, clean_env, sim_env
    from verification.sim_npu import torch_npu_wheel

    env = sim_env(clean_env(PYTHONPATH=REPO), devices=1)
    result = subprocess.run([sys.executable, "-c", NPU_PROFILER_PROGRAM, str(tmp_path)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    wheel = torch_npu_source.WheelAPI(torch_npu_wheel.wheel(), set())
    layout = torch_npu_source.profiler_trace_layout(wheel)
    problems = torch_npu_source.trace_problems(layout, str(tmp_path / "profiling" / "traces"), "rank0",
                                               int(lines["pid"]))
    fields, _ = torch_npu_source.memory_snapshot_fields(wheel)
    problems += torch_npu_source.snapshot_problems(json.loads(lines["snapshot"]), fields)
    assert not problems, "\n".join(problems)
    assert "torch_npu.profiler (CPU+NPU)" in lines["notes"]


def test_hccl_variables_we_set_are_read_by_libtorch_npu():
    """Read from the real torch_npu 2.14.0 wheel (cached zip): the environment variables the
    collectives and determinism patches set are strings of libtorch_npu.so."""
    from verification.sim_npu import torch_npu_wheel

    wheel = torch_npu_wheel.wheel()
    library = wheel.read("torch_npu/lib/libtorch_npu.so")
    for variable in ("TORCH_HCCL_TRACE_BUFFER_SIZE", "TORCH_HCCL_DUMP_ON_TIMEOUT", "TORCH_HCCL_ENABLE_MONITORING",
                     "TORCH_HCCL_DEBUG_INFO_TEMP_FILE", "HCCL_DETERMINISTIC", "HCCL_CONNECT_TIMEOUT",
                     "HCCL_ASYNC_ERROR_HANDLING"):
        assert b"\0" + variable.encode() + b"\0" in library, f"libtorch_npu.so never reads {variable}"
