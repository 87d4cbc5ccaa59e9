"""The simulated NPU's "hccl" stand-in behaves like HCCL where parallelism bugs would hide."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from verification.sim_npu import sim_env  # noqa: E402

P2P_WITH_GLOBAL_RANK = textwrap.dedent("""
    from datetime import timedelta
    import torch, torch.distributed as dist
    import torch_npu
    from torch_npu import _hccl

    # A one-rank sub-group holding global rank 1 (as a pipeline stage's group would): its
    # only valid peer id is 0, the global id 1 must be refused.
    backend = _hccl.HcclSimBackend(dist.HashStore(), 0, 1, timedelta(seconds=5))
    tensor = torch.ones(2, device="npu")
    for call in (lambda: backend.send([tensor], 1, 0), lambda: backend.recv([tensor], 1, 0)):
        try:
            call()
        except RuntimeError as error:
            print("rejected:", error)
        else:
            print("accepted")
""")


def test_sim_hccl_rejects_a_global_rank_as_p2p_peer_on_a_sub_group():
    result = subprocess.run([sys.executable, "-c", P2P_WITH_GLOBAL_RANK], env=sim_env(os.environ, devices=1),
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("p2p rank id must be smaller than group size" in line for line in lines), lines
