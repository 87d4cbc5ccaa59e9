"""The fused block kernels (rms_norm, rotary, swiglu, router_fp32) in training.

* Loss parity: llama3, qwen3 and deepseek_v3 debug models train on 2 ranks with every
  default patch on, and with the four fused-kernel patches off; fp32, deterministic,
  same seed, losses equal within 1e-4 relative at each of 4 steps (3 after optimizer updates). In the rehearsal the kernels are the
  reference (plain PyTorch); on the simulated NPU they are the stand-in's operators.
* On the simulated NPU a test-only probe (tests/support/plugins/fused_step_probe.py) counts each
  step's torch_npu kernel calls and looks for complex tensors on the device (module outputs,
  tensors saved for backward, buffers): there is none, and the census is one npu_rms_norm
  per RMSNorm module, one npu_rotary_mul per q and per k of each RoPE, one npu_swiglu per
  FeedForward and per GroupedExperts (counted in the model built on the meta device).
* Tensor parallel: llama3 with TP=2 under DTensor activations (spmd_backend
  partial_dtensor, so the stand-in's sharding strategies run) and under torchtitan's
  default spmd_types backend, against TP=1 on one rank (same batch), all from one seed checkpoint.

CI runs deepseek_v3 on the simulated NPU (MLA RoPE, MoE experts, router, census, no complex
tensor; 1-2 minutes: 59 s measured at load 3-5; steps 3 and 4 cost about 6 s each per run at load 8) and, in tests/sim/test_fused_dtensor.py, the sharding strategies on 2
ranks. The rest (the other models and targets, TP=2 training): ``pytest -m fused_matrix
tests/e2e/test_fused_train.py`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest

from testkit import PLUGINS, clean_env, from_seed, parse_losses, sim_npu_env, torchrun

FUSED_PATCHES = ("rms_norm", "rotary", "swiglu", "router_fp32")
FUSED_OFF = ",".join(f"-{patch}" for patch in FUSED_PATCHES)
PROBE_REGISTRY = os.path.join(PLUGINS, "fused_step_probe_registry.json")
CONFIGS = {"llama3": "llama3_debugmodel", "qwen3": "qwen3_debugmodel", "deepseek_v3": "deepseek_v3_debugmodel"}
STEPS = 4  # parity after 3 optimizer updates, not just the first forward; the census holds at every step
RUN = ["--training.seq_len", "128", "--training.local_batch_size", "1", "--validator.no-enable",
       "--debug.seed", "42", "--debug.deterministic", "--training.mixed_precision_param", "float32"]
NO_ACTIVATION_CHECKPOINTING = ["activation-checkpoint:none"]  # a subcommand: must come last; no recompute in the census


def fused_env(target: str, fused: bool) -> dict[str, str]:
    overrides = {"TORCHTITAN_NPU_REGISTRY": PROBE_REGISTRY, "TORCHTITAN_NPU_STRICT": "1"}
    if not fused:
        overrides["TORCHTITAN_NPU_PATCHES"] = FUSED_OFF
    if target == "sim":
        return sim_npu_env(**overrides)
    env = clean_env(TORCHTITAN_NPU="cpu", **overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PLUGINS, env.get("PYTHONPATH")]))
    return env


def fused_train(module: str, target: str, dump: str, *, fused: bool, extra=(), nproc: int = 2) -> dict[int, float]:
    args = ["--module", module, "--config", CONFIGS[module], "--training.steps", str(STEPS), *RUN,
            "--dump_folder", dump, *extra]
    if "--checkpoint.enable" not in extra:
        args.append("--checkpoint.no-enable")
    result = torchrun([*args, *NO_ACTIVATION_CHECKPOINTING], fused_env(target, fused), nproc=nproc)
    assert result.returncode == 0, result.stdout[-5000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(map(math.isfinite, losses.values())), losses
    return losses


def read_rank_files(dump: str, pattern: str) -> list[dict]:
    files = []
    for rank in (0, 1):
        with open(os.path.join(dump, pattern.format(rank=rank)), encoding="utf-8") as handle:
            files.append(json.load(handle))
    return files


def patch_states(dump: str) -> list[dict[str, str]]:
    reports = read_rank_files(dump, os.path.join("npu_inject", "report_rank{rank}.json"))
    return [{patch: report["patches"][patch]["state"] for patch in FUSED_PATCHES} for report in reports]


def max_relative_difference(losses: dict[int, float], baseline: dict[int, float]) -> float:
    assert sorted(losses) == sorted(baseline)
    return max(abs(losses[step] - baseline[step]) / abs(baseline[step]) for step in baseline)


def expected_census(module: str) -> dict[str, int]:
    """Kernel calls per step from the model's modules (built upstream, on the meta device)."""
    import torch
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import RoPE

    config = getattr(importlib.import_module(f"torchtitan.models.{module}.config_registry"), CONFIGS[module])()
    with torch.device("meta"):
        model = config.model_spec.model.build()
    modules = list(model.modules())
    norms = sum(type(m) is RMSNorm for m in modules)
    rotaries = 2 * sum(isinstance(m, RoPE) for m in modules)  # q and k
    swiglus = sum(isinstance(m, (FeedForward, GroupedExperts)) for m in modules)
    census = {}
    for op, count in (("npu_rms_norm", norms), ("npu_rotary_mul", rotaries), ("npu_swiglu", swiglus)):
        census[f"npu::{op}"] = count
    return census


def check_parity(module: str, target: str, tmp_path) -> None:
    fused_dump, upstream_dump = str(tmp_path / "fused"), str(tmp_path / "upstream")
    fused = fused_train(module, target, fused_dump, fused=True)
    upstream = fused_train(module, target, upstream_dump, fused=False)
    assert patch_states(fused_dump) == [dict.fromkeys(FUSED_PATCHES, "applied")] * 2
    assert patch_states(upstream_dump) == [dict.fromkeys(FUSED_PATCHES, "disabled")] * 2
    worst = max_relative_difference(fused, upstream)
    print(f"{module} on {target}: fused {fused}\nupstream {upstream}\nmax relative difference {worst:.2e}")
    assert worst <= 1e-4
    if target != "sim":
        return
    expected = expected_census(module)
    for probe in read_rank_files(fused_dump, "fused_step_probe_rank{rank}.json"):
        print(f"{module} kernel census per step (rank probe): {probe['npu_ops'][str(STEPS)]}")
        for step in range(1, STEPS + 1):
            census = {op: n for op, n in probe["npu_ops"][str(step)].items() if op in expected}
            assert census == expected, (step, census, expected)
            assert probe["complex_on_device"][str(step)] == {}, probe["complex_on_device"]
        assert probe["complex_buffers"] == []
    # The probe does see complex tensors: upstream's ComplexRoPE keeps its cache on the device.
    if module != "qwen3":
        (upstream_probe, _) = read_rank_files(upstream_dump, "fused_step_probe_rank{rank}.json")
        assert upstream_probe["complex_buffers"], upstream_probe


def test_fused_kernels_keep_losses_on_simulated_npus_deepseek_v3(tmp_path):
    check_parity("deepseek_v3", "sim", tmp_path)


@pytest.mark.fused_matrix
@pytest.mark.parametrize("target, module", [("cpu", "llama3"), ("cpu", "qwen3"), ("cpu", "deepseek_v3"),
                                            ("sim", "llama3"), ("sim", "qwen3")])
def test_fused_kernels_keep_losses(target, module, tmp_path):
    check_parity(module, target, tmp_path)


@pytest.mark.fused_matrix
@pytest.mark.parametrize("spmd_backend", ["partial_dtensor", "spmd_types"])
def test_tensor_parallel_with_fused_kernels_matches_tp1_on_simulated_npus(spmd_backend, tmp_path, request):
    seed_checkpoint = request.getfixturevalue("seed_checkpoint")
    # TP=2 (data parallel 1) and one rank see the same batch; both start from the seed checkpoint.
    tp2 = fused_train("llama3", "sim", str(tmp_path / "tp2"), fused=True, extra=[
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.spmd_backend", spmd_backend, *from_seed(seed_checkpoint)])
    tp1 = fused_train("llama3", "sim", str(tmp_path / "tp1"), fused=True, nproc=1, extra=[
        "--parallelism.data_parallel_shard_degree", "1", *from_seed(seed_checkpoint)])
    assert patch_states(str(tmp_path / "tp2")) == [dict.fromkeys(FUSED_PATCHES, "applied")] * 2
    worst = max_relative_difference(tp2, tp1)
    print(f"llama3 TP=2 ({spmd_backend}) {tp2}\nTP=1 (one rank) {tp1}\nmax relative difference {worst:.2e}")
    assert worst <= 1e-4
