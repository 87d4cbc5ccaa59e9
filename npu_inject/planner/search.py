"""``npu-inject plan --search``: the layouts a job could run with on N devices, planned, fastest first.

The space: the splits of the world into data-parallel replicas and shards, context, tensor, pipeline
and expert parallel degrees that torchtitan accepts for the model, with the command's global batch
held fixed (the local batch and gradient accumulation make it up), each with activation
checkpointing none, selective or full. Where the space is cut, and why:

* tensor parallel stays within the fast links (at most ``scale_up_devices``, and 8) and divides the
  attention heads (and key/value heads);
* context parallel keeps at least :data:`MIN_CP_POSITIONS` positions per rank (below that its
  exchanges cost more than the activations it saves) and an even split for the load balancer;
* pipeline parallel up to :data:`MAX_PP` stages, each with at least two layers, and each rank with at
  least as many microbatches as stages; pipelines deeper than :data:`SHALLOW_PP` stages are planned
  only when no shallower layout fits (a pipeline's stages save memory and cost bubbles, and every
  stage is a recording of its own);
* data-parallel replicas (HSDP) only across whole scale-up domains;
* expert parallel takes the largest degree that divides both the experts and the ranks experts borrow
  (dp_shard x cp x tp): the fewest experts per rank, as torchtitan's own MoE configurations choose;
* the local batch is the largest the global batch allows on the layout (no accumulation) or the
  smallest (the most accumulation).

Two passes (:func:`search`): every layout once, in its most frugal variant, then the other variants of
the fastest few. Every plan is shallow (:mod:`npu_inject.planner.depth`: three and four repeats of the
layer block per stage); the fastest that fits is planned again at full depth and the difference printed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from npu_inject.planner import workers
from npu_inject.planner.config import PlanError
from npu_inject.torchtitan_argv import with_flags

MIN_CP_POSITIONS = 4096
SHALLOW_PP, MAX_PP = 2, 8
AC_MODES = ("none", "selective", "full")
DEGREE_FLAGS = {
    "dp_replicate": "--parallelism.data_parallel_replicate_degree",
    "dp_shard": "--parallelism.data_parallel_shard_degree",
    "cp": "--parallelism.context_parallel_degree",
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
}
MANAGED_FLAGS = (*DEGREE_FLAGS.values(), "--training.local_batch_size", "--training.global_batch_size")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"{name} {value}" for name, value in vars(self).items() if value > 1]
        return " x ".join(parts) or "1 rank"


@dataclass
class Candidate:
    layout: Layout
    local_batch: int
    ac: str
    global_batch: int

    def flags(self) -> list[str]:
        values = {**vars(self.layout)}
        flags = [item for name, flag in DEGREE_FLAGS.items() for item in (flag, str(values[name]))]
        return [*flags, "--training.local_batch_size", str(self.local_batch),
                "--training.global_batch_size", str(self.global_batch)]

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` with this candidate's degrees, batch and activation checkpointing in place of its own."""
        kept, skip = [], False
        for index, arg in enumerate(argv):
            if skip:
                skip = False
                continue
            if arg.startswith("activation-checkpoint:"):
                break  # the subcommand and its own options end the command line
            name = arg.split("=", 1)[0]
            if name in MANAGED_FLAGS:
                skip = "=" not in arg
                continue
            kept.append(arg)
        return [*with_flags(kept, self.flags()), f"activation-checkpoint:{self.ac}"]

    def describe(self) -> str:
        accumulation = self.global_batch // (self.local_batch * self.layout.dp)
        return (f"{self.layout.describe()}, local batch {self.local_batch}"
                + (f" x {accumulation} accumulated" if accumulation > 1 else "") + f", AC {self.ac}")


@dataclass
class Outcome:
    candidate: Candidate
    plan: Any = None  # job.JobPlan
    refused: str = ""  # torchtitan's (or the planner's) reason it cannot run
    pruned: str = ""  # why it was not planned


@dataclass
class SearchResult:
    outcomes: list[Outcome] = field(default_factory=list)
    best: Any = None  # the fastest fitting layout planned at full depth (job.JobPlan)
    best_shallow: Any = None  # the same layout's shallow plan
    seconds: float = 0.0

    def fitting(self) -> list[Outcome]:
        return sorted((o for o in self.outcomes if o.plan is not None and o.plan.fits), key=lambda o: o.plan.step_s)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(facts: dict[str, Any], world_size: int, scale_up: int) -> list[Layout]:
    """The layouts of the space (module docstring) for this model on ``world_size`` ranks."""
    heads, kv_heads = facts.get("heads") or 1, facts.get("kv_heads") or facts.get("heads") or 1
    layers, experts, seq = facts["layers"] or 1, facts.get("experts"), facts["seq_len"]
    found = []
    for tp in _divisors(world_size):
        if tp > min(scale_up, 8) or heads % tp or kv_heads % tp:
            continue
        for cp in _divisors(world_size // tp):
            if cp > 1 and (seq // cp < MIN_CP_POSITIONS or seq % (2 * cp)):
                continue
            for pp in _divisors(world_size // (tp * cp)):
                if pp > MAX_PP or pp > 1 and layers < 2 * pp:
                    continue
                rest = world_size // (tp * cp * pp)
                replicas = [1] + [r for r in _divisors(rest) if r > 1 and world_size // r >= scale_up
                                  and (world_size // r) % scale_up == 0]
                for dp_replicate in replicas:
                    dp_shard = rest // dp_replicate
                    eps = [1] if not experts else [largest_ep(experts, dp_shard * cp * tp)]
                    for ep in eps:
                        found.append(Layout(dp_replicate, dp_shard, cp, tp, pp, ep))
    return found


def largest_ep(experts: int, borrowed: int) -> int:
    """The largest expert-parallel degree that divides both the experts and the ranks experts borrow
    (dp_shard x cp x tp): the fewest experts per rank."""
    return max(e for e in _divisors(borrowed) if experts % e == 0)


def local_batches(layout: Layout, global_batch: int, microbatch: int) -> list[int]:
    """The largest and the smallest local batch that make up the global batch on this layout."""
    if global_batch % layout.dp:
        return []
    per_rank = global_batch // layout.dp
    sizes = [b for b in _divisors(per_rank) if b % microbatch == 0 and (layout.pp == 1 or b // microbatch >= layout.pp)]
    return sorted({max(sizes), min(sizes)}, reverse=True) if sizes else []


REFINED = 3  # the fastest layouts of the first pass whose other batches and modes are planned
# How far a shallow plan's memory was from the same layout's at full depth (3 and 4 repeats of the block
# extrapolated: -9.6% to +5.3% where checked, the allocator's cache taken as the copies leave it; docs/planner.md):
# within this fraction of the device's memory, its verdict may be the other way at full depth.
SHALLOW_MEMORY_ERROR = 0.10


def near_the_limit(plan) -> bool:
    """Whether a shallow plan's memory is within :data:`SHALLOW_MEMORY_ERROR` of the device's: fitting or not,
    a full-depth plan (a single ``npu-inject plan``) may say the other."""
    return abs(plan.worst.total - plan.capacity) <= SHALLOW_MEMORY_ERROR * plan.capacity


def search(argv: list[str], facts: dict[str, Any], world_size: int, scale_up: int,
           start: Callable[[list[str], Candidate], Any], progress: Callable[[str], None] = lambda line: None,
           full: Callable[[list[str], Candidate], Any] | None = None) -> SearchResult:
    """Plan the space in two passes. ``start(argv, candidate)`` begins a shallow plan and returns an object
    whose ``wait(timeout)`` says whether its recordings have finished and whose ``result()`` is the JobPlan
    (or raises PlanError); all of a pass's plans are started at once, so the workers never wait. First pass:
    every layout with its smallest local batch and full recomputation, the most frugal variant (does not fit:
    no variant will). Second pass: for the :data:`REFINED` fastest layouts that fit, the largest batch and the
    other modes. ``full(argv, candidate)`` plans the fastest candidate at full depth (the next, if it does not
    fit): the candidates are those that fit, and those :func:`near_the_limit` that do not but are faster than
    every one that fits (a full-depth plan may find room where the shallow one did not)."""
    began = time.monotonic()
    result = SearchResult()
    global_batch = facts["global_batch_size"]

    def run(candidates: list[Candidate]) -> list[Outcome]:
        started = [(candidate, start(candidate.argv(argv), candidate)) for candidate in candidates]
        outcomes = []
        for candidate, pending in started:
            while not pending.wait(workers.next_beat(progress)):  # recorded side by side: say how far they are
                recorded = sum(1 for _, other in started if other.wait(0))
                progress(f"{recorded} of {len(started)} layouts of this pass recorded; next: {candidate.describe()}")
            try:
                job_plan = pending.result()
            except PlanError as exc:
                outcome = Outcome(candidate, refused=str(exc).splitlines()[0])
            else:
                outcome = Outcome(candidate, job_plan)
            progress(f"{candidate.describe()}: " + (
                f"refused: {outcome.refused}" if outcome.refused else
                f"{'fits' if outcome.plan.fits else 'does not fit'}, {outcome.plan.worst.total / 2**30:.1f} GiB"
                + (" (near the device's limit)" if near_the_limit(outcome.plan) else "")
                + f", {outcome.plan.tokens_per_s_per_npu:,.0f} tokens/s/NPU"))
            outcomes.append(outcome)
        result.outcomes.extend(outcomes)
        return outcomes

    batches_of: dict[Layout, list[int]] = {}
    space = []
    for layout in layouts(facts, world_size, scale_up):
        batches = local_batches(layout, global_batch, facts["microbatch_size"])
        if not batches:
            result.outcomes.append(Outcome(Candidate(layout, 0, "-", global_batch),
                                           pruned=f"the global batch {global_batch} does not split over dp {layout.dp}"))
            continue
        batches_of[layout] = batches
        space.append(layout)
    fitted: list[Outcome] = []
    for shallowest, deepest in ((1, SHALLOW_PP), (SHALLOW_PP + 1, MAX_PP)):
        first = [Candidate(layout, batches_of[layout][-1], "full", global_batch) for layout in space
                 if shallowest <= layout.pp <= deepest]
        if fitted:
            result.outcomes.extend(Outcome(c, pruned=f"a layout of at most {SHALLOW_PP} pipeline stages fits")
                                   for c in first)
            continue
        progress(f"first pass, pipelines of {shallowest} to {deepest} stages: {len(first)} layouts, each with its "
                 "smallest local batch and full recomputation")
        fitted = sorted((o for o in run(first) if o.plan is not None and o.plan.fits), key=lambda o: o.plan.step_s)
    second = []
    for outcome in fitted[:REFINED]:
        layout, batches = outcome.candidate.layout, batches_of[outcome.candidate.layout]
        second += [Candidate(layout, batch, ac, global_batch) for batch in batches for ac in AC_MODES
                   if (batch, ac) != (batches[-1], "full")]
    if second:
        progress(f"second pass: the other batches and modes of the {min(len(fitted), REFINED)} fastest layouts")
        run(second)
    fitting = result.fitting()
    fastest_fitting = fitting[0].plan.step_s if fitting else float("inf")
    contenders = sorted(fitting + [o for o in result.outcomes if o.plan is not None and not o.plan.fits
                                   and near_the_limit(o.plan) and o.plan.step_s < fastest_fitting],
                        key=lambda o: o.plan.step_s)
    if full is not None:
        for outcome in contenders[:3]:
            progress(f"planning {outcome.candidate.describe()} at full depth")
            confirmed = full(outcome.candidate.argv(argv), outcome.candidate)
            if confirmed.fits:
                result.best, result.best_shallow = confirmed, outcome.plan
                break
    result.seconds = time.monotonic() - began
    return result


def flags_text(candidate: Candidate) -> str:
    return " ".join([*candidate.flags(), f"activation-checkpoint:{candidate.ac}"])

