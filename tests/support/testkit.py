"""Helpers shared by the tests: environments, fresh interpreters, torchrun runs and loss parsing
(tools/training_runs.py's, which the tools use too), the debug runs the tests compare.

A module of its own (not conftest.py): several conftest.py files live under tests/, and
``from conftest import`` would pick whichever was imported last.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> repo
PLUGINS = os.path.join(REPO, "tests", "support", "plugins")
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # tools/ is not installed

from tools.training_runs import clean_env, parse_losses, torchrun  # noqa: E402, F401  (the tools' launch, for the tests)
from verification.sim_npu import sim_env  # noqa: E402  (the one simulated-NPU environment)


# torchtitan's release/0.3 source tree (tests/integration_tests, run_train.sh), which the upstream-suite
# tests read: an input, never a path outside the repository (.ci/run passes CI's copy).
TORCHTITAN_SRC = os.path.abspath(os.environ["TORCHTITAN_SRC"]) if os.environ.get("TORCHTITAN_SRC") else None


def needs_torchtitan_src(what: str):
    """Skips a test that reads ``what`` of torchtitan's source tree where TORCHTITAN_SRC is unset, in one line
    saying how to provide it (a TORCHTITAN_SRC that is set is used, and its errors fail the test)."""
    import pytest

    return pytest.mark.skipif(TORCHTITAN_SRC is None, reason=f"needs torchtitan's release/0.3 source tree ({what}): "
                                                             "set TORCHTITAN_SRC=<checkout>")


def run_python(code: str, env: dict[str, str], cwd: str | None = None, timeout: int = 300):
    """A fresh interpreter (site-packages .pth files processed as in real use)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


def fake_entry(module: str, triggers=("faketitan.core",), **extra) -> dict:
    """A registry entry for a test patch in tests/support/plugins (its TARGETS and docstring are the module's)."""
    return {"module": module, "triggers": list(triggers), **extra}


def reference_attention_env(**overrides: str) -> dict[str, str]:
    """Environment selecting the test-only SDPA attention instead of the attention patch."""
    return clean_env(
        TORCHTITAN_NPU="cpu",
        TORCHTITAN_NPU_REGISTRY=os.path.join(PLUGINS, "reference_registry.json"),
        TORCHTITAN_NPU_PATCHES="-attention,-muse_glimmer_masks,+sdpa_reference_attention",
        PYTHONPATH=os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")])),
        **overrides,
    )


LLAMA_STEPS = 10
DETERMINISTIC = ["--debug.seed", "42", "--debug.deterministic", "--training.mixed_precision_param", "float32"]
SHORT_RUN = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--validator.no-enable"]


def train_llama(config: str, dump: str, env: dict, steps: int = LLAMA_STEPS, extra=(), nproc: int = 2):
    """A deterministic fp32 llama3 debug run; returns (step -> loss, log)."""
    args = ["--module", "llama3", "--config", config, "--training.steps", str(steps), *SHORT_RUN,
            *DETERMINISTIC, "--dump_folder", dump, *extra]
    if "--checkpoint.enable" not in extra:
        args.append("--checkpoint.no-enable")
    result = torchrun(args, env, nproc=nproc)
    assert result.returncode == 0, result.stdout[-4000:]
    return parse_losses(result.stdout), result.stdout


def sim_npu_env(**overrides: str) -> dict[str, str]:
    """TORCHTITAN_NPU=1 on 2 simulated NPUs (verification/sim_npu), plus test plugins on PYTHONPATH.
    (TORCHTITAN_NPU_SIM_AUDIT="1" turns on the audit: <dump_folder>/npu_inject/audit_rank<N>.json.)"""
    # DTensor's offset-based RNG tracker, as on a real NPU (parity runs start from a seed checkpoint).
    base = clean_env(**{"TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_SIM_DTENSOR_RNG": "philox", **overrides})
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [PLUGINS, base.get("PYTHONPATH")]))
    return sim_env(base, devices=2)


def from_seed(seed: str) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.initial_load_path", seed]


# -- MoE rehearsal runs (tests/e2e/test_moe_train.py, test_compile_train.py) ---------------

MOE_STEPS = 10
MOE_SHORT = ["--training.seq_len", "128", "--training.local_batch_size", "1", "--validator.no-enable",
             "--checkpoint.no-enable"]
NO_ACTIVATION_CHECKPOINTING = ["activation-checkpoint:none"]  # a subcommand: must come last


def train_moe(module: str, config: str, dump: str, env: dict, steps: int = MOE_STEPS, extra=(), tail=(),
              timeout: int = 600) -> dict[int, float]:
    """A deterministic fp32 MoE debug run on 2 ranks; returns step -> loss (every step, finite)."""
    args = ["--module", module, "--config", config, "--training.steps", str(steps), *MOE_SHORT,
            *DETERMINISTIC, "--dump_folder", dump, *extra, *tail]
    result = torchrun(args, env, nproc=2, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, steps + 1)), result.stdout[-3000:]
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    return losses


def apply_with_step_owner(patch_module, device_kind: str = "cpu", options=None):
    """Apply patch ``step_owner``, then ``patch_module`` (a step patch, which takes part in it), as the runtime
    does (tests that stand in for torchtitan's methods set them first). Returns (the patch's context, restore)."""
    from npu_inject import module_facts
    from npu_inject.patches import step_owner
    from npu_inject.patching import PatchContext

    contexts = []
    for module, patch_options in ((step_owner, {}), (patch_module, options or {})):
        ctx = PatchContext(patch_id=module.__name__.rsplit(".", 1)[1], device_kind=device_kind,
                           options=patch_options, declared_targets=module_facts.declared_names(module))
        module.apply(ctx)
        contexts.append(ctx)

    def restore() -> None:
        for ctx in reversed(contexts):
            ctx.restore()

    return contexts[1], restore
