"""A model or config the target cannot train stops at start-up, in one line naming what is missing and how to get it.

torchtitan's ``ConfigManager.parse_args`` (the first thing ``torchtitan.train``
does) resolves ``--module``/``--config`` in ``_load_config``: it imports
``torchtitan.models.<module>.config_registry`` (swallowing any ImportError into
"Cannot import config_registry") and calls the config function, then merges the
command line. Several families and configs need things the core install does not
have, and failed deep inside that path. This patch wraps ``parse_args`` and, on
both targets:

* before the import: checks the family's optional packages (kimi_k2_7, qwen3_5:
  torchvision; flux: transformers) and that qwen3_5's ``fla`` imports are served by
  the gated_delta_net patch's stand-in (fla itself is Triton/CUDA kernels);
* while the config function runs: a quantization converter (float8, MXFP8,
  NVFP4) that refuses the device becomes a line naming the recipe and its needs;
* after the command line is merged: a size or count the job cannot take stops before the
  data loader or a patch divides by it or indexes with it (``--training.seq_len 0``,
  ``--training.local_batch_size 0``, negative ``--training.steps``, a parallelism degree
  below 1); so does an optimizer torchtitan runs on CUDA only
  (kimi_k2_7's DistMuon); so does an ``--override.imports`` module whose kernel
  package is not importable (torchtitan's ``overrides.helion_rope`` without helion, a CUDA
  kernel DSL; ``overrides.fused_swiglu``/``fused_mla``, which define Triton kernels at import,
  without triton), where torchtitan would fail when the trainer applies the overrides; and
  local data the config reads must exist: the tokenizer folder a Hugging Face tokenizer is built
  from (``--hf_assets_path``, default ``./tests/assets/tokenizer``; torchtitan built it after the
  model and failed in a long traceback), the data set
  path torchtitan resolves (``--dataloader.dataset_path``, else the name's default such as
  ``tests/assets/c4_test``), SFT ``data_files``, Flux's autoencoder; a torchft job
  (``--fault_tolerance.enable``) needs torchft, a process group the target can carry,
  a lighthouse that answers and, with patch torchft_leave, a train timeout that a
  survivor's quorum outlasts (``model_checks.hang_timeout_problem``).

Each stop is ``SystemExit`` with one line that names what is missing and how to
get it (an optional package at the version npu-inject's extra pins, :mod:`npu_inject.extras`). Configs that
can train pass through unchanged.
"""

from __future__ import annotations

import sys

from npu_inject import runtime
from npu_inject.errors import stop_run
from npu_inject.model_checks import (
    data_problem,
    family_problem,
    fault_tolerance_problem,
    optimizer_problem,
    override_problem,
    quantization_problem,
    selection,
    setting_problem,
)
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.config.manager:ConfigManager.parse_args",
)


def patch_selected(patch_id: str) -> bool:
    """Whether this run's selection has ``patch_id`` on (waiting for its trigger, or applied)."""
    active = runtime.current()
    state = active.states.get(patch_id) if active is not None else None
    return state is not None and state.state in ("pending", "applied")


def apply(ctx: PatchContext) -> None:
    def parse_args(original, manager, args=None):
        argv = sys.argv[1:] if args is None else list(args)
        family, config_name = selection(argv)
        problem = family_problem(family, ctx.device_kind)
        if problem is None:
            try:
                config = original(manager, argv)
            except (ImportError, ValueError) as exc:
                problem = quantization_problem(exc, config_name, ctx.device_kind)
                if problem is None:
                    raise
            else:
                # After the command line is merged: a --dataloader.* override may point elsewhere.
                problem = (setting_problem(config) or optimizer_problem(config, config_name, ctx.device_kind)
                           or override_problem(config, ctx.device_kind) or data_problem(config, config_name)
                           or fault_tolerance_problem(config, ctx.device_kind,
                                                      hccl_group=patch_selected("torchft_npu"),
                                                      leave_watchdog=patch_selected("torchft_leave")))
                if problem is None:
                    return config
        stop_run(f"npu_inject model_guard: {problem}")

    ctx.wrap("ConfigManager.parse_args", parse_args)
