"""The job the planner is asked for: torchtitan's configuration, parsed and checked before anything is built.

The job is parsed from the same torchtitan flags the training command takes, with the flags every
recording forces (:data:`FORCED_FLAGS`: torchtitan's fake process group, no checkpoint, no validation,
torchtitan's memory line at every step), and checked as ``model_guard`` checks it for the NPU target
(:mod:`npu_inject.model_checks`) and against the world size; a job that cannot be planned is a
:class:`PlanError` with one line saying why.

The runtime runs the CPU rehearsal's patches (the NPU target's code paths, with the NPU kernels'
fakes), less those whose work is a probe or a host-side choice: ``rehearsal_dtype`` (the NPU keeps
bf16), ``optimizer`` (its probe steps a real optimizer; the NPU runs torchtitan's fused AdamW, as on
the emulation), ``model_guard``, whose checks the planner runs itself except the presence of the
data set and the tokenizer (neither is read), and ``host_memory_check``, which runs the planner (a
recording would plan itself again). ``compile`` is planned as eager (noted in the result).
"""

from __future__ import annotations

from typing import Any

from npu_inject import model_checks
from npu_inject.torchtitan_argv import with_flags

PLANNER_EXCLUDED = ("rehearsal_dtype", "optimizer", "model_guard", "host_memory_check")
FORCED_FLAGS = ("--comm.mode", "fake_backend", "--checkpoint.no-enable", "--validator.no-enable",
                "--metrics.log_freq", "1")
# While it waits, npu-inject plan prints a line at least this often (seconds): a large model's recording takes minutes.
HEARTBEAT_S = 10.0


class PlanError(Exception):
    """The job cannot be planned as asked: one line saying why (torchtitan's or model_guard's message)."""


def environment(selection: str = "") -> dict[str, str]:
    """The runtime's settings for a recording: the rehearsal target, the user's ``selection`` of patches
    (``TORCHTITAN_NPU_PATCHES`` syntax) less the planner's exclusions."""
    excluded = ",".join(f"-{patch_id}" for patch_id in PLANNER_EXCLUDED)
    return {"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_PATCHES": f"{selection},{excluded}" if selection else excluded}


def _parse(argv: list[str]):
    """torchtitan's configuration for ``argv``, or PlanError with torchtitan's (tyro's) own message."""
    import contextlib
    import io

    from torchtitan.config import ConfigManager

    _, config_name = model_checks.selection(argv)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            return ConfigManager().parse_args(argv)
    except (ImportError, ValueError) as exc:
        problem = model_checks.quantization_problem(exc, config_name, "npu")
        raise PlanError(problem or f"torchtitan refused the configuration: {exc}") from None
    except SystemExit:
        # tyro prints a titled panel (a box on a terminal, rules otherwise) after whatever torchtitan
        # printed: keep the panel's words.
        lines = [line.strip(" │╭╮╰╯─┃━┏┓┗┛-") for line in printed.getvalue().splitlines()]
        rules = [i for i, line in enumerate(printed.getvalue().splitlines()) if line.strip() and not lines[i]]
        panel = lines[max(rules[0] - 1, 0):] if rules else lines
        message = "; ".join(line for line in panel if line and not line.startswith(("For full helptext", "usage:", "/")))
        raise PlanError(f"torchtitan refused the command line: {message or 'see --help'}") from None


def guard(argv: list[str], world_size: int):
    """model_guard's start-up checks for the NPU target, but the data's presence (data set, tokenizer), and
    the layout against the world size; the parsed configuration."""
    family, config_name = model_checks.selection(argv)
    problem = model_checks.family_problem(family, "npu")
    if problem:
        raise PlanError(problem)
    config = _parse(argv)
    problem = (model_checks.setting_problem(config) or model_checks.optimizer_problem(config, config_name, "npu")
               or model_checks.override_problem(config, "npu") or layout_problem(config.parallelism, world_size))
    if problem:
        raise PlanError(problem)
    return config


def layout_problem(parallelism, world_size: int) -> str | None:
    """Why torchtitan would refuse these degrees on ``world_size`` ranks, in one line; None if it would not."""
    names = {"dp_replicate": parallelism.data_parallel_replicate_degree, "cp": parallelism.context_parallel_degree,
             "tp": parallelism.tensor_parallel_degree, "pp": parallelism.pipeline_parallel_degree}
    fixed = names["dp_replicate"] * names["cp"] * names["tp"] * names["pp"]
    shown = " x ".join(f"{name} {degree}" for name, degree in names.items())
    dp_shard = parallelism.data_parallel_shard_degree
    if dp_shard == -1:
        if world_size % fixed:
            return (f"the layout's degrees ({shown} = {fixed}) do not divide the {world_size} ranks "
                    "(--parallelism.data_parallel_shard_degree -1 takes the rest)")
        dp_shard = world_size // fixed
    elif fixed * dp_shard != world_size:
        return (f"the layout's degrees ({shown} x dp_shard {dp_shard} = {fixed * dp_shard}) are not the "
                f"{world_size} ranks planned")
    ep = parallelism.expert_parallel_degree
    if ep > 1 and (dp_shard * names["cp"] * names["tp"]) % ep:
        return (f"--parallelism.expert_parallel_degree {ep} does not divide dp_shard {dp_shard} x cp {names['cp']} "
                f"x tp {names['tp']} = {dp_shard * names['cp'] * names['tp']} (torchtitan borrows experts' ranks "
                "from these)")
    return None


def describe(argv: list[str], world_size: int) -> dict[str, Any]:
    """What the layout search needs to know of the job: the model's shape and the batch it trains on."""
    from npu_inject.planner import stages

    config = guard(with_flags(argv, list(FORCED_FLAGS)), world_size)
    model = config.model_spec.model
    layers = getattr(model, "layers", None) or []
    last = layers[-1] if layers else None
    attention = getattr(last, "attention", None)
    parallelism, training = config.parallelism, config.training
    dp = world_size // (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
                        * parallelism.pipeline_parallel_degree)
    return {
        "model": f"{config.model_spec.name} {config.model_spec.flavor}",
        "layers": len(layers),
        "heads": getattr(attention, "n_heads", None),
        "kv_heads": getattr(attention, "n_kv_heads", None) or getattr(attention, "n_heads", None),
        "experts": experts(config),
        "seq_len": training.seq_len,
        "local_batch_size": training.local_batch_size,
        "global_batch_size": training.global_batch_size if training.global_batch_size > 0
        else training.local_batch_size * dp,
        "microbatch_size": parallelism.pipeline_parallel_microbatch_size,
        "pp": parallelism.pipeline_parallel_degree,
        "dp": dp,
        "pp_schedule": parallelism.pipeline_parallel_schedule,
        "activation_checkpoint": activation_checkpoint_mode(config),
        # What each pipeline stage holds: stages of one kind can share a recording (npu_inject.planner.stages).
        **(stages.stage_facts(config) if parallelism.pipeline_parallel_degree > 1
           else {"stage_kinds": [], "stage_first_layers": []}),
    }


def experts(config) -> int | None:
    """The routed experts of the model's last layer (an MoE model's), or None."""
    layers = getattr(config.model_spec.model, "layers", None) or []
    return getattr(getattr(layers[-1], "moe", None), "num_experts", None) if layers else None


def activation_checkpoint_mode(config) -> str:
    """The job's activation checkpointing as the search names it (none, selective, full), another kind by its class."""
    if config.activation_checkpoint is None:
        return "none"
    name = type(config.activation_checkpoint).__qualname__.split(".")[0]
    return {"FullAC": "full", "SelectiveAC": "selective"}.get(name, name)
