"""``--compile.enable`` on the real torch_npu 2.14.0 wheel (the CANN emulation) trains like eager.

Here the compile patch picks aot_eager (torch_npu's inductor needs Triton-Ascend and a driver:
docs/compile.md), so each block runs as aot_autograd's forward and backward graphs, op by op, through
the real wheel: its fake (Meta) implementations trace the blocks and its kernels run them. A fake that
disagrees with its kernel fails here and in no other target (gpt_oss_fsdp+tp+ep+compile met one:
npu::_npu_moe_token_unpermute without probs, tests/cann_emu/test_moe.py). Per-step losses are checked
against the CPU rehearsal's eager run from the same seed within 1e-4 relative, as in test_train.py.

CI runs deepseek_v3 with expert parallel 2 (the all-to-all dispatch, grouped matmul and token
permutation, compiled); ``-m cann_emu_long`` adds llama3.

    .venv/bin/python -m pytest -m "cann_emu or cann_emu_long" tests/cann_emu/test_compile_emulated.py -n 0
"""

from __future__ import annotations

import json

import pytest

from test_train import MODELS, RUN, STEPS, emulated
from testkit import NO_ACTIVATION_CHECKPOINTING, clean_env, parse_losses, torchrun

# A rank still compiling a block keeps the other waiting at the next collective, past the 100 s default.
COMPILED = ["--compile.enable", "--comm.train_timeout_seconds", "1200"]
PARAMS = [pytest.param("deepseek_v3_ep2"), pytest.param("llama3", marks=[pytest.mark.cann_emu_long])]


@pytest.mark.parametrize("name", PARAMS)
def test_compiled_on_the_real_wheel_trains_like_the_eager_rehearsal(name, tmp_path):
    args = [*MODELS[name], *RUN, *COMPILED]
    run, _ = emulated(args, tmp_path / "emulated", timeout=1500, tail=NO_ACTIVATION_CHECKPOINTING)
    assert run.returncode == 0, run.stdout[-6000:]
    rehearsal = torchrun([*MODELS[name], *RUN, "--dump-folder", str(tmp_path / "rehearsal"),
                          *NO_ACTIVATION_CHECKPOINTING], clean_env(TORCHTITAN_NPU="cpu"), nproc=2)
    assert rehearsal.returncode == 0, rehearsal.stdout[-6000:]
    compiled, eager = parse_losses(run.stdout), parse_losses(rehearsal.stdout)
    print(f"{name} compiled on the emulation {compiled}\neager rehearsal {eager}")
    assert sorted(compiled) == list(range(1, STEPS + 1))
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-4), step
    for rank in (0, 1):
        report = json.loads((tmp_path / "emulated" / "npu_inject" / f"report_rank{rank}.json").read_text())
        record = report["patches"]["compile"]
        assert record["state"] == "applied", record
        assert any(note.startswith("torch.compile backend for the model blocks: aot_eager (")
                   for note in record["notes"]), record
