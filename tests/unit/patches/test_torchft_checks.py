"""torchft's bad input is one line at start-up (model_checks.fault_tolerance_problem, model_guard's check)."""

from __future__ import annotations

import importlib.util
import socket
from types import SimpleNamespace

import pytest

from npu_inject import model_checks


def _config(**ft):
    return SimpleNamespace(fault_tolerance=SimpleNamespace(**{"enable": True, "process_group": "gloo", **ft}))


@pytest.fixture
def lighthouse_port():
    """A port something listens on (standing in for torchft's lighthouse)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_run_without_fault_tolerance_is_not_checked():
    assert model_checks.fault_tolerance_problem(SimpleNamespace(), "cpu") is None
    assert model_checks.fault_tolerance_problem(_config(enable=False, process_group="nope"), "cpu") is None


def test_rehearsal_with_a_lighthouse_passes_and_each_bad_input_is_one_line(lighthouse_port):
    here = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}"}
    for group in ("nccl", "hccl", "gloo"):
        assert model_checks.fault_tolerance_problem(_config(process_group=group), "cpu", here) is None
    for group in ("nccl", "hccl"):  # on NPUs both run on the runtime's HCCL group (patch torchft_npu)
        assert model_checks.fault_tolerance_problem(_config(process_group=group), "npu", here) is None
    problems = {
        "group": model_checks.fault_tolerance_problem(_config(process_group="hcc"), "cpu", here),
        "mccl": model_checks.fault_tolerance_problem(_config(process_group="mccl"), "cpu", here),
        "npu_gloo": model_checks.fault_tolerance_problem(_config(), "npu", here),
        "npu_patch_off": model_checks.fault_tolerance_problem(_config(process_group="hccl"), "npu", here,
                                                              hccl_group=False),
        "unset": model_checks.fault_tolerance_problem(_config(), "cpu", {}),
        "closed": model_checks.fault_tolerance_problem(_config(), "cpu",
                                                      {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{_closed_port()}"}),
        "malformed": model_checks.fault_tolerance_problem(_config(), "cpu", {"TORCHFT_LIGHTHOUSE": "localhost"}),
    }
    assert all(problem and "\n" not in problem for problem in problems.values()), problems
    assert problems["group"].startswith("--fault_tolerance.process_group 'hcc' does not exist: torchtitan's "
                                        "TorchFTManager builds gloo, nccl, mccl, hccl")
    assert "mccl is torchcomms' CUDA backend" in problems["mccl"]
    assert problems["npu_gloo"] == ("--fault_tolerance.process_group gloo cannot carry NPU tensors (gloo: host "
                                    "tensors; mccl: torchcomms' CUDA backend): use --fault_tolerance.process_group hccl")
    assert problems["npu_patch_off"].startswith("--fault_tolerance.process_group hccl on NPUs needs patch torchft_npu")
    assert problems["unset"].startswith("--fault_tolerance.enable needs torchft's lighthouse")
    assert problems["closed"].startswith(f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:") and "no lighthouse answers" in problems["closed"]
    assert problems["malformed"] == "TORCHFT_LIGHTHOUSE='localhost' is not http://host:port"


def test_torchft_missing_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    # the project is installed from a clone, not from PyPI: the line names torchft at the extra's pin
    assert model_checks.fault_tolerance_problem(_config(), "cpu", {}) == (
        "--fault_tolerance.enable needs torchft, not installed: pip install 'torchft~=0.2.0' (npu-inject's "
        "torchft extra)")


def test_replica_groups_without_checkpointing_stop_naming_the_flag(lighthouse_port):
    """Upstream registers the state a group heals from only with --checkpoint.enable: without it two groups
    failed at their first quorum ("user state_dict is not initialized", then 60 s lock timeouts)."""
    here = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}"}

    def problem(group_size: int, enable: bool):
        config = _config(group_size=group_size)
        config.checkpoint = SimpleNamespace(enable=enable)
        return model_checks.fault_tolerance_problem(config, "cpu", here)

    assert problem(2, enable=False).startswith("--fault_tolerance.group_size 2 needs --checkpoint.enable: ")
    assert problem(2, enable=True) is None
    assert problem(1, enable=False) is None  # one group heals from nobody


def _timeouts(train_timeout_seconds: int):
    config = _config()
    config.comm = SimpleNamespace(train_timeout_seconds=train_timeout_seconds)
    return config


def test_a_train_timeout_the_quorum_would_not_outlast_stops_when_torchft_leave_is_on(lighthouse_port):
    here = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}"}
    check = model_checks.fault_tolerance_problem
    # upstream's llama3_torchft_debugmodel: 15 s + torchft's 5 s heartbeat timeout < its 60 s quorum timeout
    assert check(_timeouts(15), "cpu", here, leave_watchdog=True) is None
    assert check(_timeouts(54), "cpu", here, leave_watchdog=True) is None
    default = check(_timeouts(100), "cpu", here, leave_watchdog=True)  # torchtitan's default train timeout
    assert default == (
        "--comm.train_timeout_seconds 100 plus the lighthouse's heartbeat timeout (torchft's default 5 s) is not "
        "under torchft's quorum timeout (60 s, TORCHFT_QUORUM_TIMEOUT_SEC): a hung rank in one replica group would "
        "hold the other groups' quorum until it times out and every group would go down; use "
        "--comm.train_timeout_seconds below 55 (llama3_torchft_debugmodel sets 15) or raise "
        "TORCHFT_QUORUM_TIMEOUT_SEC (docs/fault-tolerance.md)")
    assert check(_timeouts(55), "cpu", here, leave_watchdog=True).startswith("--comm.train_timeout_seconds 55 ")
    # a longer quorum timeout admits it; torchft_leave off: no watchdog makes the group leave, nothing to check
    assert check(_timeouts(100), "cpu", {**here, "TORCHFT_QUORUM_TIMEOUT_SEC": "120"}, leave_watchdog=True) is None
    assert check(_timeouts(100), "cpu", here, leave_watchdog=False) is None
    assert check(_timeouts(0), "cpu", here, leave_watchdog=True) is None  # no train timeout set
    assert check(_timeouts(15), "cpu", {**here, "TORCHFT_QUORUM_TIMEOUT_SEC": "1.5"}, leave_watchdog=True) == (
        "TORCHFT_QUORUM_TIMEOUT_SEC='1.5' is not a whole number of seconds (torchft reads it with int())")
