"""rehearsal_dtype: which dtype the rehearsal computes in, decided once per job by rank 0's CPU flags.

The end-to-end run (2 ranks whose probes disagree) is tests/e2e/test_train_rehearsal.py.
"""

from __future__ import annotations

import logging
import types

import pytest

from npu_inject import module_facts, rehearsal_compute_dtype
from npu_inject.patching import PatchContext
from npu_inject.patches import rehearsal_dtype

EMULATED = (False, "no bf16 instructions among this x86_64 CPU's flags (avx512_bf16, amx_bf16, bf16 absent)",
            1e-3, 30e-3)  # (native per the flags, which flags, fp32 s, bf16 s)
NATIVE = (True, "the CPU has avx512_bf16", 1e-3, 0.5e-3)
# The flags decide: a probe timed under load (bf16 faster than fp32 on a CPU without bf16) changes nothing.
EMULATED_UNDER_LOAD = (False, EMULATED[1], 10.63e-3, 9.11e-3)


@pytest.mark.parametrize("choice, configured, figures, dtype, says", [
    ("keep", "bfloat16", None, "bfloat16", "rehearsal computes in bfloat16: the job's training.mixed_precision_param, "
                                           "kept by registry option compute_dtype=keep"),
    ("float32", "bfloat16", None, "float32", "rehearsal computes in float32: registry option compute_dtype=float32 "
                                             "(the job's training.mixed_precision_param is bfloat16)"),
    ("auto", "float32", None, "float32", "rehearsal computes in float32: the job's training.mixed_precision_param"),
    ("auto", "bfloat16", EMULATED, "float32", "rehearsal computes in float32 instead of bfloat16: the CPU has no "
                                              "bf16 instructions (no bf16 instructions among this x86_64 CPU's flags "
                                              "(avx512_bf16, amx_bf16, bf16 absent); rank 0's probe 256x512x512 "
                                              "matmul, for information: fp32 1.00 ms, bf16 30.00 ms (30.0x))"),
    ("auto", "bfloat16", EMULATED_UNDER_LOAD, "float32", "rehearsal computes in float32 instead of bfloat16: the "
                                                         "CPU has no bf16 instructions"),
    ("auto", "bfloat16", NATIVE, "bfloat16", "rehearsal computes in bfloat16: the CPU has avx512_bf16 "
                                             "(rank 0's probe 256x512x512 matmul, for information: fp32 1.00 ms, "
                                             "bf16 0.50 ms (0.5x))"),
])
def test_decision_names_the_dtype_and_why(choice, configured, figures, dtype, says):
    chosen, message = rehearsal_compute_dtype.decide(choice, configured, figures)
    assert chosen == dtype and message.startswith(says), message


def test_auto_without_figures_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="compute_dtype=auto with mixed_precision_param='bfloat16' needs rank 0's probe"):
        rehearsal_compute_dtype.decide("auto", "bfloat16", None)


def test_probe_times_both_dtypes():
    fp32, bf16, ratio = rehearsal_compute_dtype.bf16_slowdown()
    assert fp32 > 0 and bf16 > 0 and ratio == pytest.approx(bf16 / fp32)


def test_the_choice_is_the_same_across_five_probes_on_a_loaded_host():
    """Five probes while another thread keeps a core busy with matmuls: the timings move, the choice does not
    (issue 43: one run under load chose bf16 on a CPU without bf16 instructions, four chose float32)."""
    import threading

    import torch

    stop = threading.Event()

    def load():
        a = torch.randn(512, 512)
        while not stop.is_set():
            a @ a

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        choices = {rehearsal_compute_dtype.decide("auto", "bfloat16", rehearsal_compute_dtype.cpu_probe())[0]
                   for _ in range(5)}
    finally:
        stop.set()
        loader.join()
    assert len(choices) == 1, choices


def _apply(monkeypatch, option: str, stub_init):
    """The patch applied over a stand-in Trainer.__init__ (upstream's would build a model)."""
    import torchtitan.trainer

    monkeypatch.setattr(torchtitan.trainer.Trainer, "__init__", stub_init)
    ctx = PatchContext(patch_id="rehearsal_dtype", device_kind="cpu", options={"compute_dtype": option},
                       declared_targets=module_facts.declared_names(rehearsal_dtype))
    rehearsal_dtype.apply(ctx)
    return ctx, torchtitan.trainer.Trainer


def _config(mixed_precision_param: str):
    return types.SimpleNamespace(training=types.SimpleNamespace(mixed_precision_param=mixed_precision_param))


def test_auto_computes_in_rank0s_choice_not_its_own_probe(monkeypatch, caplog):
    monkeypatch.setattr(rehearsal_dtype, "cpu_probe", lambda: NATIVE)  # this rank: native bf16
    seen = {}

    def init(trainer, config):
        # What Trainer.init_distributed's rank agreement does: hand every rank rank 0's proposal.
        ((name, proposal, use),) = ctx.agreements
        seen["proposal"] = name, proposal
        use(EMULATED)  # rank 0 measured emulated bf16
        seen["fsdp_reads"] = config.training.mixed_precision_param  # as parallelize_fn does, afterwards

    ctx, trainer_class = _apply(monkeypatch, "auto", init)
    try:
        with caplog.at_level(logging.INFO, logger="npu_inject"):
            trainer_class.__init__(object.__new__(trainer_class), _config("bfloat16"))
    finally:
        ctx.restore()
    assert seen == {"proposal": ("bf16_probe", NATIVE), "fsdp_reads": "float32"}
    (line,) = [record.getMessage() for record in caplog.records if "rehearsal computes" in record.getMessage()]
    assert line.startswith("npu_inject: rehearsal computes in float32 instead of bfloat16"), line
    assert ctx.notes == [line.removeprefix("npu_inject: ")]


def test_auto_without_the_rank_agreement_fails_instead_of_keeping_bf16_silently(monkeypatch):
    monkeypatch.setattr(rehearsal_dtype, "cpu_probe", lambda: EMULATED)
    ctx, trainer_class = _apply(monkeypatch, "auto", lambda trainer, config: None)
    try:
        with pytest.raises(RuntimeError, match="without the runtime's rank agreement"):
            trainer_class.__init__(object.__new__(trainer_class), _config("bfloat16"))
    finally:
        ctx.restore()


def test_forced_float32_needs_no_probe_and_says_so(monkeypatch, caplog):
    def no_probe():
        raise AssertionError("compute_dtype=float32 must not probe")

    monkeypatch.setattr(rehearsal_dtype, "cpu_probe", no_probe)
    seen = {}

    def init(trainer, config):
        seen["agreements"] = list(ctx.agreements)
        seen["fsdp_reads"] = config.training.mixed_precision_param

    ctx, trainer_class = _apply(monkeypatch, "float32", init)
    try:
        with caplog.at_level(logging.INFO, logger="npu_inject"):
            trainer_class.__init__(object.__new__(trainer_class), _config("bfloat16"))
    finally:
        ctx.restore()
    assert seen == {"agreements": [], "fsdp_reads": "float32"}
    assert "npu_inject: rehearsal computes in float32: registry option compute_dtype=float32" in caplog.text
