"""torch_npu's profiler on the CANN emulation (verification/cann_emu/csrc/profiling.cpp, issue 20).

One child process of the emulation's venv profiles a few training steps of a small model with the real
``torch_npu.profiler`` (CPU and NPU activities, a wait/warmup/active schedule, shapes and memory,
``tensorboard_trace_handler``), then profiles the same steps with CPU activity only, then re-parses the
first run offline with ``torch_npu.profiler.profiler.analyse``. The parent reads what torch_npu wrote
back: the FRAMEWORK data its C++ dumped, and ``ASCEND_PROFILER_OUTPUT/trace_view.json`` as Chrome-trace
JSON, whose operators are held against the ones the steps ran (the aten operators of the model's forward
and backward, as plain PyTorch names them) per ProfilerStep, with timestamps inside the child's own
wall-clock window. The emulation writes no device-side PROF_* data, so the parser takes its
framework-only path, as for a CPU-only run; the test holds both runs' file lists equal.

A second child calls the aclprof* C API through ctypes and checks each return code against msprof's own
code on hicann/runtime's 9.1.0 branch (the version the emulation reports), the loud failures included.

    CANN_EMU_VENV=.venv-cann .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu/test_profiling.py -n 0
"""

from __future__ import annotations

import collections
import csv
import json
import subprocess
from pathlib import Path

import pytest

from cann_emu_child import PYTHON, REPO, child_json
from testkit import clean_env, parse_losses
from verification.cann_emu import cann_env

PROFILE = """
import ctypes, glob, json, os, shutil, time
import torch, torch_npu
from torch_npu.profiler.profiler import analyse

root = %(root)r
STEP_OPS = %(ops)r
lib = ctypes.CDLL("libcann_emu.so")
lib.cann_emu_profiling_state.restype = ctypes.c_char_p
state = lambda: json.loads(lib.cann_emu_profiling_state())
P = torch_npu.profiler
out = {}

torch.manual_seed(0)
w = torch.randn(32, 32, device="npu", requires_grad=True)
x = torch.randn(16, 32, device="npu")

def steps(prof, n):
    for _ in range(n):
        loss = torch.nn.functional.silu(torch.mm(x, w)).sum()
        loss.backward()
        loss.item()
        prof.step()

raw = lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)

def run(name, activities):
    t0, w0 = raw(), time.time()
    with P.profile(activities=activities, schedule=P.schedule(wait=1, warmup=1, active=2, repeat=1),
                   on_trace_ready=P.tensorboard_trace_handler(os.path.join(root, name)),
                   record_shapes=True, profile_memory=True) as prof:
        steps(prof, 5)
    t1 = raw()
    (path,) = glob.glob(os.path.join(root, name, "*_ascend_pt"))
    return {"path": path, "raw_t0_ns": t0, "raw_t1_ns": t1, "wall_s": time.time() - w0, "state": state(),
            "monotonic_minus_raw_ms": (time.monotonic_ns() - raw()) / 1e6}

# The reference: plain PyTorch's own profiler over one such step on the CPU.
wc, xc = w.detach().cpu().requires_grad_(), x.cpu()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ref:
    torch.nn.functional.silu(torch.mm(xc, wc)).sum().backward()
out["cpu_reference"] = {op: sum(1 for e in ref.events() if e.name == op) for op in STEP_OPS}

out["npu"] = run("npu", [P.ProfilerActivity.CPU, P.ProfilerActivity.NPU])
out["cpu_only"] = run("cpu_only", [P.ProfilerActivity.CPU])

# Offline: a copy of the NPU run without its parsed output, parsed again by torch_npu's analyse().
offline = os.path.join(root, "offline")
shutil.copytree(os.path.join(root, "npu"), offline)
(copy,) = glob.glob(os.path.join(offline, "*_ascend_pt"))
shutil.rmtree(os.path.join(copy, "ASCEND_PROFILER_OUTPUT"))
t0 = time.time()
analyse(offline)
out["offline"] = {"path": copy, "wall_s": time.time() - t0}
print(json.dumps(out))
"""


# The aten operators one step of silu(x @ w).sum() and its backward runs, as plain PyTorch's profiler
# counts them on the CPU (test_reference_step_ops): the forward mm, silu, sum; the backward's
# silu_backward and the mm for w's gradient (x needs none).
STEP_OPS = {"aten::mm": 2, "aten::silu": 1, "aten::sum": 1, "aten::silu_backward": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cann_prof")
    return child_json(PROFILE % {"root": str(root), "ops": sorted(STEP_OPS)}, timeout=240)


def trace(path: str) -> list[dict]:
    events = json.loads((Path(path) / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    assert isinstance(events, list) and events, "trace_view.json is not a non-empty Chrome-trace event list"
    return events


def files(path: str) -> set[str]:
    return {str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file() and "logs" not in p.parts}


def test_reference_step_ops(runs):
    """STEP_OPS is what plain PyTorch's profiler counts for the same step on the CPU."""
    assert runs["cpu_reference"] == STEP_OPS


def test_cann_profiling_calls(runs):
    """NPU activity: torch_npu initialised, warmed up, started, stopped and finalised msprof once each, and
    nothing is left running; CPU activity alone never reaches CANN's profiling."""
    npu, cpu_only = runs["npu"]["state"], runs["cpu_only"]["state"]
    calls = npu["calls"]
    for name in ("aclprofInit", "aclprofWarmup", "aclprofStart", "aclprofStop", "aclprofFinalize",
                 "aclprofCreateConfig", "aclprofDestroyConfig", "aclprofRegisterDeviceCallback",
                 "aclprofGetSupportedFeaturesV2"):
        assert calls.get(name) == 1, (name, calls)
    assert calls.get("aclprofSetConfig") == 2  # profile_memory: ACL_PROF_SYS_HARDWARE_MEM_FREQ at warmup and start
    assert npu["initialized"] is False and npu["running_devices"] == []
    assert npu["result_path"] == runs["npu"]["path"]
    assert cpu_only["calls"] == calls, "a CPU-only profile called CANN's profiling"


def test_framework_data_and_fwk_only_outputs(runs):
    """torch_npu's C++ wrote its FRAMEWORK data; with no PROF_* directory the parser took the framework-only
    path and wrote the same files as for a CPU-only profile (what a real machine writes without CANN data)."""
    path = Path(runs["npu"]["path"])
    for name in ("torch.op_range", "torch.op_mark", "torch.memory_usage"):
        assert (path / "FRAMEWORK" / name).stat().st_size > 0, name
    assert not list(path.glob("PROF_*")), "the emulation must not invent device-side CANN data"
    expected = {"profiler_info.json", "profiler_metadata.json", "FRAMEWORK/torch.op_range",
                "FRAMEWORK/torch.op_mark", "FRAMEWORK/torch.memory_usage",
                "ASCEND_PROFILER_OUTPUT/trace_view.json", "ASCEND_PROFILER_OUTPUT/operator_details.csv",
                "ASCEND_PROFILER_OUTPUT/memory_record.csv", "ASCEND_PROFILER_OUTPUT/operator_memory.csv",
                "ASCEND_PROFILER_OUTPUT/analyse.done"}
    assert files(str(path)) == expected
    assert files(runs["cpu_only"]["path"]) == expected
    info = json.loads((path / "profiler_info.json").read_text())
    assert info["config"]["common_config"]["activities"] == ["ProfilerActivity.CPU", "ProfilerActivity.NPU"]


@pytest.mark.parametrize("run", ["npu", "cpu_only", "offline"])
def test_trace_view_per_step(runs, run):
    """Chrome-trace events: two ProfilerStep spans (the schedule's active steps 2 and 3), each holding the
    step's aten operators with the aclnn operator torch_npu launched for them, with non-negative durations,
    inside the run's time window. torch_npu stamps events with CLOCK_MONOTONIC_RAW (its C++
    Utils::GetClockTime without the system counter) and shifts them by profiler_info.json's
    collectionTimeEnd - MonotonicTimeEnd; undone here, every event lies within the child's own
    CLOCK_MONOTONIC_RAW readings around the run."""
    events = trace(runs[run]["path"])
    window = runs["npu" if run == "offline" else run]
    end = json.loads((Path(runs[run]["path"]) / "profiler_info.json").read_text())["end_info"]
    shift_us = (int(end["collectionTimeEnd"]) - int(end["MonotonicTimeEnd"])) / 1e3
    spans = [e for e in events if e.get("ph") == "X"]
    for e in spans:
        assert float(e["dur"]) >= 0, e
        raw_us = float(e["ts"]) - shift_us
        assert window["raw_t0_ns"] / 1e3 - 1e3 <= raw_us <= window["raw_t1_ns"] / 1e3 + 1e3, (e, window)
    steps = sorted((e for e in spans if e["name"].startswith("ProfilerStep#")), key=lambda e: float(e["ts"]))
    assert [e["name"] for e in steps] == ["ProfilerStep#2", "ProfilerStep#3"]
    for step in steps:
        start, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        # any thread: the backward's operators run on autograd's thread while the step's thread waits
        inside = collections.Counter(e["name"] for e in spans if start <= float(e["ts"]) <= end)
        for op, n in STEP_OPS.items():
            assert inside[op] == n, (step["name"], op, inside)
        for launched in ("aclnnMm", "aclnnSilu", "aclnnSiluBackward", "aclnnReduceSum"):
            assert inside[launched] >= 1, (step["name"], launched, inside)


def test_offline_analyse_matches_trace_handler(runs):
    """torch_npu's offline analyse() of the same raw data writes the same events as the trace handler."""
    key = lambda e: (e.get("ph"), e.get("name"), str(e.get("ts")), str(e.get("dur")))
    assert sorted(map(key, trace(runs["offline"]["path"]))) == sorted(map(key, trace(runs["npu"]["path"])))


def test_operator_details_and_memory(runs):
    """operator_details.csv lists the step operators with shapes; the memory files hold the NPU's
    allocations (profile_memory=True)."""
    out = Path(runs["npu"]["path"]) / "ASCEND_PROFILER_OUTPUT"
    with open(out / "operator_details.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    names = collections.Counter(r["Name"] for r in rows)
    assert names["aten::mm"] == 4 and names["aten::silu_backward"] == 2, names
    mm_shapes = {"".join(r["Input Shapes"].split()) for r in rows if r["Name"] == "aten::mm"}
    assert mm_shapes == {"16,32;32,32", "32,16;16,32"}, mm_shapes  # x @ w, and x.t() @ grad for w's gradient
    with open(out / "memory_record.csv", newline="") as f:
        memory = list(csv.DictReader(f))
    assert memory and {r["Device Type"] for r in memory} == {"NPU:0"}
    assert all(float(r["Total Allocated(MB)"]) >= 0 for r in memory)


C_API = """
import ctypes, json
lib = ctypes.CDLL("libcann_emu.so")
lib.aclprofCreateConfig.restype = ctypes.c_void_p
lib.aclprofCreateConfig.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_uint64]
for name in ("aclprofStart", "aclprofStop", "aclprofWarmup", "aclprofDestroyConfig"):
    getattr(lib, name).argtypes = [ctypes.c_void_p]
lib.aclprofInit.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
lib.aclprofSetConfig.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
lib.aclGetRecentErrMsg.restype = ctypes.c_char_p
lib.cann_emu_profiling_state.restype = ctypes.c_char_p
lib.aclprofGetSupportedFeaturesV2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_void_p)]

LEVEL0 = 0x800 | 0x1          # torch_npu's Level0: ACL_PROF_TASK_TIME_L0 | ACL_PROF_ACL_API
LEVEL1 = 0x2 | 0x1 | 0x20 | 0x4
NONE = 0xFF
out = {}
def config(devices, switches, metrics=NONE, events=None):
    arr = (ctypes.c_uint32 * max(len(devices), 1))(*devices)
    return lib.aclprofCreateConfig(arr if devices else None, len(devices), metrics, events, switches)
def call(name, *args):
    rc = getattr(lib, name)(*args)
    msg = lib.aclGetRecentErrMsg()
    out.setdefault(name, []).append([rc, msg.decode() if msg else ""])
    return rc
def state():
    return json.loads(lib.cann_emu_profiling_state())

bad = {"device 8 of 8": config([8], LEVEL0), "duplicate": config([0, 0], LEVEL0),
       "events": config([0], LEVEL0, events=ctypes.c_void_p(1)), "no device": config([], LEVEL0)}
out["bad configs"] = {k: v is None for k, v in bad.items()}
out["create message"] = lib.aclGetRecentErrMsg().decode()
c0 = config([0], LEVEL0)
call("aclprofStop", c0)                 # before aclprofInit
call("aclprofWarmup", c0)               # before aclprofInit
call("aclprofInit", None, 0)
call("aclprofInit", b"/tmp/x", 3)
call("aclprofInit", b"/tmp/cann_prof_api", 18)
call("aclprofInit", b"/tmp/cann_prof_api", 18)
call("aclprofSetConfig", 3, b"50", 2)
call("aclprofSetConfig", 3, b"500", 3)
call("aclprofSetConfig", 17, b"1", 1)
call("aclprofSetConfig", 8, b"cpu,mem", 7)
call("aclprofSetConfig", 8, b"cpu,gpu", 7)
call("aclprofStop", c0)                 # initialised, nothing started
call("aclprofStart", config([0], LEVEL0 | 0x800000000))  # ACL_PROF_AICORE_SHAPE: not in 9.1.0's switches
call("aclprofStart", c0)
out["running"] = state()["running_devices"]
call("aclprofStart", c0)                # the same switches again: accepted, nothing new started
call("aclprofStart", config([0], LEVEL1, metrics=1))  # other switches on a running device
call("aclprofWarmup", c0)
call("aclprofStop", config([0], LEVEL1, metrics=1))
call("aclprofStop", c0)
out["after stop"] = state()["running_devices"]
call("aclprofFinalize")
call("aclprofFinalize")
call("aclprofDestroyConfig", None)
call("aclprofDestroyConfig", c0)
call("aclprofDestroyConfig", c0)
size, data = ctypes.c_size_t(0), ctypes.c_void_p(None)
call("aclprofGetSupportedFeaturesV2", ctypes.byref(size), ctypes.byref(data))
# FeatureRecord: a vtable pointer, featureName[64], then FeatureInfo (a vtable pointer, four char[16], char[128]).
record = 8 + 64 + 8 + 4 * 16 + 128
names = [ctypes.string_at(data.value + i * record + 8).decode() for i in range(size.value)]
versions = [ctypes.string_at(data.value + i * record + 8 + 64 + 8 + 16).decode() for i in range(size.value)]
out["features"] = [names, versions]
print(json.dumps(out))
"""


def test_aclprof_c_api_contract():
    """The return codes of msprof's 9.1.0 code (msprofiler_acl_api.cpp, prof_acl_api.cpp, prof_acl_mgr.cpp),
    with a message for aclGetRecentErrMsg where CANN reports one: invalid configs are refused (null), a
    second aclprofInit is ACL_ERROR_REPEAT_INITIALIZE (100002), warmup before init ACL_ERROR_PROF_NOT_RUN
    (100043), warmup after start ACL_ERROR_PROF_API_CONFLICT (148047), other switches on a running device
    ACL_ERROR_INVALID_PROFILING_CONFIG (100010), an unsupported switch ACL_ERROR_PROF_MODULES_UNSUPPORTED
    (200007). Stop and finalize without init succeed (9.1.0's code; the document says they fail)."""
    out = child_json(C_API, timeout=60)
    assert out["bad configs"] == {"device 8 of 8": True, "duplicate": True, "events": True, "no device": True}
    assert "deviceNums can not be 0" in out["create message"]
    rc = {name: [r for r, _ in calls] for name, calls in out.items() if name.startswith("aclprof")}
    msg = {name: [m for _, m in calls] for name, calls in out.items() if name.startswith("aclprof")}
    assert rc["aclprofInit"] == [100000, 100000, 0, 100002]
    assert "already initialised" in msg["aclprofInit"][3]
    assert rc["aclprofWarmup"] == [100043, 148047]
    assert "aclprofInit must be called" in msg["aclprofWarmup"][0]
    assert rc["aclprofSetConfig"] == [0, 100010, 100000, 0, 100010]
    assert rc["aclprofStart"] == [200007, 0, 0, 100010]
    assert "is not supported" in msg["aclprofStart"][0]
    assert out["running"] == [0, 64]  # device 0 and the host task aclprofCreateConfig appends
    assert rc["aclprofStop"] == [0, 0, 100010, 0]
    assert out["after stop"] == []
    assert rc["aclprofFinalize"] == [0, 0]
    assert rc["aclprofDestroyConfig"] == [100000, 0, 100000]
    assert rc["aclprofGetSupportedFeaturesV2"] == [0]
    assert out["features"] == [["ATTR", "MemoryAccess"], ["2", "2"]]  # CHIP_V4_1_0 (Ascend910B2)


def test_torchtitan_two_ranks_profile_every_launch(tmp_path):
    """``TORCHTITAN_NPU=1 torchrun ... --profiler.enable-profiling``, 2 ranks of llama3: npu_inject's
    profiling patch records with torch_npu.profiler (CPU+NPU); schedule wait 1, warmup 1, active 1 puts
    ProfilerStep#2 on training step 3 (after step 1's process-group timeout change, which runs outside a
    step). Each rank's trace_view.json holds, inside that step, exactly the aclnn operators and HCCL
    collectives the emulated CANN counted for step 3 (CANN_EMU_COUNTS): torch_npu's profiler missed no
    launch."""
    dump = tmp_path / "run"
    env = cann_env(clean_env(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
                   counts=str(dump / "counts_{pid}.json"))
    command = [str(PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
               "--training.steps", "3", "--training.seq_len", "128", "--training.local_batch_size", "1",
               "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
               "--profiler.enable-profiling", "--profiler.profile-freq", "3", "--profiler.profiler-warmup", "1",
               "--profiler.profiler-active", "1", "--dump-folder", str(dump)]
    run = subprocess.run(command, env=env, cwd=REPO, timeout=600, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert run.returncode == 0, run.stdout[-6000:]
    assert sorted(parse_losses(run.stdout)) == [1, 2, 3]
    counts = {}  # per rank (by pid; torchrun's agent counted no step): what CANN saw in step 3
    for path in dump.glob("counts_*.json"):
        data = json.loads(path.read_text())
        if "3" in data["steps"]:
            counts[str(data["pid"])] = data["steps"]["3"]
    traces = sorted((dump / "profiling" / "traces").glob("rank*_ascend_pt"))
    assert [t.name.split("_")[0] for t in traces] == ["rank0", "rank1"]
    assert len(counts) == 2
    for trace_dir in traces:
        pid = trace_dir.name.split("_")[1]
        assert not list(trace_dir.glob("PROF_*"))
        spans = [e for e in trace(str(trace_dir)) if e.get("ph") == "X"]
        (step,) = [e for e in spans if e["name"].startswith("ProfilerStep#")]
        assert step["name"] == "ProfilerStep#2"
        start, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        inside = collections.Counter(e["name"] for e in spans if start <= float(e["ts"]) <= end)
        aclnn = {name: n for name, n in inside.items() if name.startswith("aclnn")}
        hccl = {name.removeprefix("Enqueue@").lower(): n for name, n in inside.items()
                if name.startswith("Enqueue@Hccl")}
        cann = counts[pid]
        assert aclnn == cann["aclnn"], trace_dir.name
        collectives = {"hcclallgather", "hcclallreduce", "hcclreducescatter"}
        assert hccl == {name.lower(): n for name, n in cann["hccl"].items() if name.lower() in collectives}
        assert sum(aclnn.values()) > 500  # a llama3 debug step launches hundreds of operators
