"""tools/forklaunch.py keeps a run on the real torchrun when it sets a variable the warm server's
imports could have read (tests/e2e/test_forklaunch.py checks a forked run against torchrun)."""

from __future__ import annotations

from testkit import REPO  # noqa: F401  (first: puts the repository root on sys.path for tools/)
from tools import forklaunch


def test_variables_read_at_import_keep_a_run_on_torchrun():
    server = {"PATH": "/bin", "HF_HUB_OFFLINE": "1"}
    assert forklaunch.import_time_differences(
        {**server, "TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_SIM_DEVICES": "2", "PYTHONPATH": "/x", "CKPT_TEST": "1"},
        server) == []
    assert forklaunch.import_time_differences(
        {**server, "TORCHINDUCTOR_CACHE_DIR": "/c", "OMP_NUM_THREADS": "4"}, server) == [
            "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"]
    assert forklaunch.import_time_differences({"PATH": "/bin"}, server) == ["HF_HUB_OFFLINE"]
