"""The CPU rehearsal checks at start-up that this host can hold the job, and stops in one line if it cannot.

Every rank of a rehearsal runs on this host and shares its memory, so a job larger than the host used
to end under the kernel's OOM killer minutes in (upstream's ``deepseek_v3_hsdp+ep`` at its shapes
through ``run_train.sh``: SIGKILL after 351 s), whatever launched it. When torchtitan's ``Trainer``
is built, rank 0 plans the job once, in a subprocess, as
``npu-inject plan --hardware cpu --ngpu <WORLD_SIZE> <the training flags>`` does, while the other
ranks wait for it in ``Trainer.init_distributed``; the runtime hands rank 0's verdict to every rank
(``PatchContext.agree_with_rank0``) before the model is built. The plan is at full depth, the
command's verdict: the rehearsal's debug models are a few layers deep, where a shallow plan (two
recordings) saves nothing. It is recorded without the SPMD type checker (``--debug.spmd_typechecking``),
which allocates nothing it counts and under which the planner refuses some layouts. The verdict is the
planner's (``npu_inject/planner/host_memory.py``): the planned need times ``HOST_MARGIN`` against
MemAvailable, to which the ranks' own anonymous resident memory is added back (the need counts each
rank's process, and they are running while the check runs).

* fits: one line in rank 0's log and a report note on every rank;
* does not fit: every rank stops (``SystemExit``) with one line naming what the job needs, what the host
  has and what would fit: the first halved local batch (else, at local batch 1, halved sequence length)
  at which the plan, its activations scaled by the tokens per microbatch, would fit, planned once more
  to confirm it (the line says whether it was planned or only estimated);
* not checked (the planner cannot plan the job, or would take longer than the process group's start-up
  timeout, ``--comm.init_timeout_seconds``, less a minute, allows): logged and reported as a fallback,
  and the run goes on. A job that spans hosts (``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) and a
  ``--comm.mode`` dry run (one process) are not checked; the report notes it.

A plan costs 15 to 30 s at start-up (most of it the planner's own imports of torch and torchtitan; the plans of
upstream's 4-rank MoE cases took 13 to 15 s), a third of a debug job's run. So rank 0 first bounds the job
from above, in this process and without planning (:func:`upper_bound`, well under a second): the model built on
the meta device as torchtitan builds it, every rank taken to hold all of it (``BYTES_PER_PARAMETER``: fp32
parameters, gradients, Adam's two moments and FSDP's unsharded copies, no sharding credit), and each rank's
activations bounded by the tokens of a microbatch times every weight's largest output per token (an MoE layer's
experts: the router's top_k of them, however it spreads the tokens), ``ACTIVATION_FACTOR`` times over, plus each
attention layer's full score matrices. When the bound, with the planner's margin, fits in half of what the host
has (``BOUND_SAFETY``), the job fits and is not planned: the line says so and gives the bound. Otherwise (the
bound comes near the host's memory, or cannot be made: pipeline parallelism, a model that is not torchtitan's
Decoder) the job is planned as before, rank 0 saying why and that it takes 15 to 30 s. The dense debug configs at
the quickstart's shape are bounded (llama3_debugmodel: 0.0 s); the MoE debug configs (80 to 320 million
parameters at 24 B each) are planned. ``tests/e2e/test_host_memory_bound.py`` holds the bound above the plan for
every text model's debug config at two shapes (3.4 times the plan at least, 2026-11-29).

Switch it off with ``TORCHTITAN_NPU_PATCHES=-host_memory_check``; ``npu-inject suite``, which plans each case
itself, does, and the planner's own recordings run without it (``PLANNER_EXCLUDED``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext
from npu_inject.torchtitan_argv import with_flags

TARGETS = (
    "torchtitan.trainer:Trainer.__init__",
)

logger = logging.getLogger("npu_inject")

GIB = 2**30
FITS, DOES_NOT_FIT, UNCHECKED = "fits", "does not fit", "not checked"
# torchrun's per-rank variables: the planner's subprocess is no rank of this job.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
START_UP_SPARE_S = 60  # of the process group's start-up timeout, left to the waiting ranks beyond the plan
UNCHECKED_TYPES = "--debug.no-spmd_typechecking"  # planned without the SPMD type checker (check(), why)
SHORTEST_SEQ_LEN = 128  # the shortest sequence length the advice suggests
# The upper bound (upper_bound): bytes per parameter every rank may hold (fp32 parameter, gradient, Adam's two
# moments; FSDP's unsharded parameter and gradient of a layer, taken for the whole model); bytes of each weight's
# largest output per token (fp32), times the tensors saved or made around it (its input, norms, activations,
# residuals, the loss's softmax); the attention scores' fp32 copies per head (scores, probabilities, gradient).
BYTES_PER_PARAMETER = 24
ACTIVATION_FACTOR = 8
SCORE_COPIES = 3
BOUND_SAFETY = 2.0  # the bound, with the planner's margin, must fit this many times over to skip the plan


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def plan_document(argv: list[str], world_size: int, timeout_s: float) -> tuple[dict | None, str]:
    """(``npu-inject plan --hardware cpu --json``'s document for ``argv`` on ``world_size`` ranks, ""), or
    (None, why it could not be planned)."""
    env = {name: value for name, value in os.environ.items()
           if name != "TORCHTITAN_NPU" and name not in LAUNCHER_VARIABLES and not name.startswith("TORCHELASTIC_")}
    with tempfile.TemporaryDirectory(prefix="npu_inject_host_check_") as folder:
        path = os.path.join(folder, "plan.json")
        command = [sys.executable, "-m", "npu_inject", "plan", "--hardware", "cpu", "--ngpu", str(world_size),
                   "--json", path, *argv]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, (f"npu-inject plan took over {timeout_s:.0f} s, longer than the other ranks can wait "
                          "(--comm.init_timeout_seconds)")
        if not os.path.isfile(path):
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            said = [line for line in lines if line.startswith("npu-inject plan:")]  # its one line, not a warning
            return None, (said or lines or [f"npu-inject plan exited {done.returncode}"])[-1][:300]
        with open(path, encoding="utf-8") as handle:
            return json.load(handle), ""


def available_now(ranks_here: int) -> int | None:
    """Bytes this host could give the job's ranks: MemAvailable now, plus what the ranks already hold of their
    own, which the need counts: this rank's anonymous resident memory stands for each (they all wait at the same
    point; the libraries' pages are shared and MemAvailable counts them). None without /proc (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            available = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))
        with open("/proc/self/status", encoding="ascii") as handle:
            held = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return None
    return available + ranks_here * held


def available_to_job(document: dict, ranks_here: int) -> int:
    """:func:`available_now` once the planner has exited; without /proc, the planner's own figure."""
    available = available_now(ranks_here)
    return document["host"]["available_bytes"] if available is None else available


def asked_bytes(document: dict, scale: float = 1.0) -> float:
    """What the verdict asks of the host for the planned job, its activations and temporaries scaled by
    ``scale`` (the tokens per microbatch, relative to the planned job's)."""
    host, roles = document["host"], document["roles"]
    ranks_per_role = document["world_size"] // len(roles)
    need = 0.0
    for role in roles:
        held = role["at_peak_bytes"]
        states = sum(held.get(name, 0) for name in ("parameters", "gradients", "optimizer states", "communication"))
        need += ranks_per_role * (states + (role["total_bytes"] - states) * scale + host["process_baseline_bytes"])
    return need * host["margin"]


def smaller_shapes(local_batch_size: int, seq_len: int) -> list[tuple[str, float]]:
    """The shapes the advice tries, in order, each with its tokens per microbatch relative to the job's:
    the local batch halved, then at local batch 1 the sequence halved."""
    shapes = []
    batch = local_batch_size // 2
    while batch >= 1:
        shapes.append((f"--training.local_batch_size {batch}", batch / local_batch_size))
        batch //= 2
    seq = seq_len // 2
    while seq >= SHORTEST_SEQ_LEN and seq_len % seq == 0:
        shapes.append((f"--training.local_batch_size 1 --training.seq_len {seq}", seq / (seq_len * local_batch_size)))
        seq //= 2
    return shapes


def would_fit(document: dict, available: int, local_batch_size: int, seq_len: int,
              plan: Callable[[list[str]], dict | None] | None = None) -> str:
    """What would fit ``available`` bytes: the first smaller shape whose estimate (the plan's activations
    scaled by its tokens per microbatch) fits, planned by ``plan(flags)`` (a plan document, or None) where
    given; when its plan refutes the estimate, the next shape the estimate finds, unplanned."""
    refuted = ""
    for flags, scale in smaller_shapes(local_batch_size, seq_len):
        if asked_bytes(document, scale) > available:
            continue
        planned = plan(flags.split()) if plan is not None and not refuted else None
        if planned is None:
            return f"{flags} (estimated from the plan{refuted})"
        asked = asked_bytes(planned)
        if asked <= available:
            return f"{flags} (planned: about {_gib(asked)} GiB with the margin)"
        refuted = f"; {flags}, planned, asks {_gib(asked)} GiB"
    return (f"no smaller batch or sequence{refuted}: without activations the job still asks about "
            f"{_gib(asked_bytes(document, 0.0))} GiB (parameters, gradients, optimizer states and each process's "
            f"own {_gib(document['host']['process_baseline_bytes'])} GiB, with the margin); fewer ranks or a "
            "smaller --config")


def verdict(document: dict, available: int, ranks_here: int, local_batch_size: int, seq_len: int,
            plan: Callable[[list[str]], dict | None] | None = None) -> tuple[str, str]:
    """(FITS or DOES_NOT_FIT, the line saying so) for the plan ``document`` and ``available`` bytes; ``plan``
    checks the advice (:func:`would_fit`)."""
    host = document["host"]
    asked = asked_bytes(document)
    per_rank = " + ".join(_gib(role["total_bytes"]) for role in document["roles"])
    need = (f"the rehearsal's {ranks_here} ranks on this host need about {_gib(host['need_bytes'])} GiB "
            f"(per rank {per_rank} GiB planned + {_gib(host['process_baseline_bytes'])} GiB for torch and "
            f"torchtitan), {_gib(asked)} GiB with the planner's {host['margin'] - 1:.0%} margin")
    if asked <= available:
        return FITS, f"host memory checked: {need}; {_gib(available)} GiB available"
    return DOES_NOT_FIT, (
        f"this host cannot hold the job: {need}, and {_gib(available)} GiB are available (MemAvailable and what "
        f"the ranks hold already); it would be ended by the OOM killer. What would fit: "
        f"{would_fit(document, available, local_batch_size, seq_len, plan)}. The plan: npu-inject plan --hardware "
        f"cpu --ngpu {document['world_size']} <these flags>; to run anyway: TORCHTITAN_NPU_PATCHES=-host_memory_check")


def upper_bound(config) -> tuple[int | None, str]:
    """(bytes one rank of the job can need at most, besides its process's own; how it was bounded), or
    (None, why no bound): see the module's docstring. Runs on the meta device: nothing is allocated."""
    import copy

    import torch

    if config.parallelism.pipeline_parallel_degree > 1:
        return None, "a pipeline schedule keeps several microbatches' activations"
    model_config = copy.deepcopy(config.model_spec.model)  # torchtitan updates and builds its own later
    layers = getattr(model_config, "layers", None)
    if not isinstance(layers, (list, tuple)):
        return None, f"{type(model_config).__qualname__} is not torchtitan's Decoder"
    heads = [getattr(layer.attention, "n_heads", None) for layer in layers
             if getattr(layer, "attention", None) is not None]
    if None in heads:
        return None, "an attention layer's config has no n_heads"
    try:
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            model = model_config.build()
    except Exception as exc:  # the job itself will say what is wrong, with its own traceback
        return None, f"the model could not be built on the meta device ({type(exc).__name__}: {exc})"
    parameters = sum(tensor.numel() for tensor in model.parameters())
    # a token visits top_k of an MoE layer's experts, however the router spreads the tokens
    # (the experts' weights, E x out x in, are an MoE module's 3-D parameters beside its router)
    top_k = {id(tensor): module.router.top_k for module in model.modules()
             if isinstance(getattr(getattr(module, "router", None), "top_k", None), int)
             for tensor in module.parameters() if tensor.dim() == 3}
    per_token = sum(top_k[id(tensor)] * max(tensor.shape[1:]) if id(tensor) in top_k
                    else tensor.numel() // min(tensor.shape)
                    for tensor in model.parameters() if tensor.dim() >= 2)
    batch, seq_len = config.training.local_batch_size, config.training.seq_len
    states = parameters * BYTES_PER_PARAMETER
    activations = batch * seq_len * per_token * 4 * ACTIVATION_FACTOR
    scores = batch * sum(heads) * seq_len**2 * 4 * SCORE_COPIES
    return states + activations + scores, (
        f"{parameters:,} parameters x {BYTES_PER_PARAMETER} B, {batch * seq_len:,} tokens x {per_token:,} outputs "
        f"x 4 B x {ACTIVATION_FACTOR}, {sum(heads)} heads' {seq_len}^2 scores x {SCORE_COPIES}")


def bound_verdict(bound: int, how: str, available: int, ranks_here: int) -> str | None:
    """The FITS line when the bound, with the planner's margin, fits ``BOUND_SAFETY`` times over, else None."""
    from npu_inject.planner.host_memory import HOST_MARGIN, PROCESS_BASELINE_BYTES

    asked = ranks_here * (bound + PROCESS_BASELINE_BYTES) * HOST_MARGIN
    if asked * BOUND_SAFETY > available:
        return None
    return (f"host memory checked by an upper bound, not planned: the rehearsal's {ranks_here} ranks need at most "
            f"{_gib(asked)} GiB with the planner's {HOST_MARGIN - 1:.0%} margin (per rank {_gib(bound)} GiB: {how}; "
            f"+ {_gib(PROCESS_BASELINE_BYTES)} GiB for torch and torchtitan), under half of the {_gib(available)} "
            "GiB available; npu-inject plan --hardware cpu gives the planned figure")


def check(argv: list[str], world_size: int, timeout_s: float, local_batch_size: int, seq_len: int,
          config=None) -> tuple[str, str]:
    """Rank 0's verdict: (FITS, DOES_NOT_FIT or UNCHECKED, the line saying so). With the job's ``config``, a job
    whose upper bound fits twice over is not planned."""
    started = time.monotonic()
    why_planned = ""
    if config is not None:
        bound, how = upper_bound(config)
        available = available_now(world_size)
        if bound is not None and available is not None:
            line = bound_verdict(bound, how, available, world_size)
            if line is not None:
                return FITS, f"{line} (bounded in {time.monotonic() - started:.1f} s at start-up)"
            how = f"its upper bound ({how}) comes near this host's memory"
        elif bound is not None:
            how = "no /proc/meminfo to hold an upper bound against"
        why_planned = f"; planned because {how}"
        logger.info("npu_inject: host memory check: planning the job (npu-inject plan --hardware cpu, 15 to 30 s): %s",
                    how)
    # spmd_types' type checker allocates nothing the plan counts, and the planner's recording refuses some
    # layouts under it (deepseek_v3 with HSDP and EP: "No valid sharding strategy for register_hook").
    planned_argv = with_flags(argv, [UNCHECKED_TYPES])
    document, why_not = plan_document(planned_argv, world_size, timeout_s)
    if document is None:
        return UNCHECKED, f"host memory not checked: the planner could not plan this job ({why_not}{why_planned})"

    def plan_advice(flags: list[str]) -> dict | None:
        left_s = timeout_s - (time.monotonic() - started)
        return plan_document(with_flags(planned_argv, flags), world_size, left_s)[0] if left_s >= 30 else None

    available = available_to_job(document, world_size)
    status, line = verdict(document, available, world_size, local_batch_size, seq_len, plan_advice)
    return status, f"{line} (planned in {time.monotonic() - started:.1f} s at start-up{why_planned})"


def apply(ctx: PatchContext) -> None:
    used: list[str] = []  # the verdicts the rank agreement handed over (none: it did not run)

    def use(agreed: tuple[str, str]) -> None:
        status, line = agreed
        used.append(status)
        if status == DOES_NOT_FIT:
            ctx.note(line)  # the report, written as the process exits, says why it stopped
            stop_run(f"npu_inject host_memory_check: {line}")
        if status == UNCHECKED:
            ctx.fallback(line)
            return
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("npu_inject: %s", line)
        ctx.note(line)

    def trainer_init(original, trainer, config, *args, **kwargs):
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        if config.comm.mode != "default":
            ctx.note(f"host memory not checked: --comm.mode {config.comm.mode} runs one process for every rank")
            return original(trainer, config, *args, **kwargs)
        if ranks_here != world_size:
            ctx.note(f"host memory not checked: the job spans hosts ({ranks_here} of its {world_size} ranks here); "
                     "the check plans a rehearsal whose ranks all run on one host")
            return original(trainer, config, *args, **kwargs)
        timeout_s = max(config.comm.init_timeout_seconds - START_UP_SPARE_S, 30)
        training = config.training
        proposal = (check(sys.argv[1:], world_size, timeout_s, training.local_batch_size, training.seq_len, config)
                    if int(os.environ.get("RANK", "0")) == 0 else None)
        used.clear()
        ctx.agree_with_rank0("verdict", proposal, use)
        result = original(trainer, config, *args, **kwargs)
        if not used:
            ctx.fallback("host memory not checked: Trainer.__init__ ran without the runtime's rank agreement "
                         "(npu_inject.rank_agreement on Trainer.init_distributed), which hands rank 0's verdict "
                         "to every rank")
        return result

    ctx.wrap("Trainer.__init__", trainer_init)
