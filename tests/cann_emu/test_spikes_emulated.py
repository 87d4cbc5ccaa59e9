"""Patch spikes' cost through the real torch_npu 2.14.0 on the CANN emulation (issue 57).

Upstream llama3 debug, 2 ranks, 4 steps, once with ``+spikes`` (both watches) and once without: the losses are
equal (nothing is judged before the warmup), and each step of the watched run makes the same host
synchronisations and device-to-host copies as the plain run's, one more HCCL all-reduce (the loss's two
floats) and a few more aclnn launches (7 measured: the loss's sum, its count, the stack read with the norm). The
truth is the emulation's own per-step counts (CANN_EMU_COUNTS), not the patch. The first run of this test caught
``torch.tensor(1.0, device=...)``: a host-to-device copy and a stream sync every step.

    .venv/bin/python -m pytest -m cann_emu_long tests/cann_emu/test_spikes_emulated.py -n 0
"""

from __future__ import annotations

import pytest

from test_train import emulated, steps_of
from testkit import parse_losses

RUN = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "4", "--training.seq_len", "128",
       "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
       "--metrics.log_freq", "1"]


@pytest.mark.cann_emu_long
def test_the_loss_watch_adds_one_all_reduce_and_no_host_synchronisation_per_step(tmp_path):
    watched, watched_counts = emulated(RUN, tmp_path / "watched", extra_env={"TORCHTITAN_NPU_PATCHES": "+spikes"})
    assert watched.returncode == 0, watched.stdout[-4000:]
    plain, plain_counts = emulated(RUN, tmp_path / "plain")
    assert plain.returncode == 0, plain.stdout[-4000:]
    losses, reference = parse_losses(watched.stdout), parse_losses(plain.stdout)
    print(f"watched {losses}\nplain {reference}")
    assert losses == reference and len(losses) == 4
    for rank in (0, 1):
        on, off = steps_of(watched_counts[rank]), steps_of(plain_counts[rank])
        for step in (2, 3, 4):  # warmed up
            syncs_on, syncs_off = on[step]["syncs"], off[step]["syncs"]
            all_reduces = on[step]["hccl"].get("HcclAllReduce", 0) - off[step]["hccl"].get("HcclAllReduce", 0)
            launches = sum(on[step]["aclnn"].values()) - sum(off[step]["aclnn"].values())
            print(f"rank {rank} step {step}: syncs {syncs_on} (plain {syncs_off}), all-reduces +{all_reduces}, "
                  f"aclnn launches +{launches}")
            assert syncs_on == syncs_off
            assert all_reduces == 1
