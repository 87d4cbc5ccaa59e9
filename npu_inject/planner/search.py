"""``npu-inject plan --search``: the layouts a job could run with on N devices, planned, fastest first.

The space: every split of the world into data-parallel replicas and shards, context, tensor, pipeline
and expert parallel degrees that torchtitan accepts for the model, with the global batch of the
command held fixed (the local batch and gradient accumulation make it up), and activation
checkpointing none, selective or full. Where the space is cut, and why:

* tensor parallel stays within the fast links (at most ``scale_up_devices``, and 8) and divides the
  attention heads (and key/value heads);
* context parallel keeps at least :data:`MIN_CP_POSITIONS` positions per rank (below that its
  exchanges cost more than the activations it saves) and an even split for the load balancer;
* pipeline parallel gives each stage at least two layers, and each rank at least as many
  microbatches as stages;
* data-parallel replicas (HSDP) only across whole scale-up domains;
* expert parallel divides the experts and the ranks experts borrow (dp_shard x cp x tp), and keeps
  at least 1/8 of them, as torchtitan's own configurations do;
* activation checkpointing and the local batch are chosen per layout: the largest local batch first
  and, for it, the least recomputation that fits; a smaller batch (more accumulation) only when no
  mode fits the larger one or recomputation was needed;
* a pipelined layout is planned only while its lower bound (the least compute per token any planned
  layout showed, stretched by the schedule's bubble) beats the fastest layout found.

Every layout is planned shallow (:mod:`npu_inject.planner.depth`: one and two repeats of the layer
block per stage); the fastest that fits is planned again at full depth and the difference printed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from npu_inject.planner.session import PlanError

MIN_CP_POSITIONS = 4096
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
        from npu_inject.planner.session import with_flags

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
                if pp > 1 and layers < 2 * pp:
                    continue
                rest = world_size // (tp * cp * pp)
                replicas = [1] + [r for r in _divisors(rest) if r > 1 and world_size // r >= scale_up
                                  and (world_size // r) % scale_up == 0]
                for dp_replicate in replicas:
                    dp_shard = rest // dp_replicate
                    borrowed = dp_shard * cp * tp
                    eps = [1] if not experts else [e for e in _divisors(borrowed)
                                                   if experts % e == 0 and e * 8 >= min(borrowed, experts)]
                    for ep in eps:
                        found.append(Layout(dp_replicate, dp_shard, cp, tp, pp, ep))
    return found


def local_batches(layout: Layout, global_batch: int, microbatch: int) -> list[int]:
    """Local batches that make up the global batch on this layout, largest first (at most three)."""
    if global_batch % layout.dp:
        return []
    per_rank = global_batch // layout.dp
    sizes = [b for b in _divisors(per_rank) if b % microbatch == 0 and (layout.pp == 1 or b // microbatch >= layout.pp)]
    return sorted(sizes, reverse=True)[:3]


def search(argv: list[str], facts: dict[str, Any], world_size: int, scale_up: int,
           plan: Callable[[list[str], Candidate], Any], progress: Callable[[str], None] = lambda line: None,
           full: Callable[[list[str], Candidate], Any] | None = None) -> SearchResult:
    """Plan the space; ``plan(argv, candidate)`` gives a shallow JobPlan or raises PlanError; ``full`` plans
    the winner at full depth."""
    started = time.monotonic()
    result = SearchResult()
    global_batch = facts["global_batch_size"]
    space = layouts(facts, world_size, scale_up)
    # Unpipelined layouts first: they give the compute per token the pipelined ones are bounded by.
    space.sort(key=lambda layout: (layout.pp, layout.tp, layout.cp, -layout.ep, layout.dp_replicate))
    least_compute = None  # NPU-seconds of compute per token, the least any plan showed
    fastest = None
    for layout in space:
        batches = local_batches(layout, global_batch, facts["microbatch_size"])
        if not batches:
            result.outcomes.append(Outcome(Candidate(layout, 0, "-", global_batch),
                                           pruned=f"the global batch {global_batch} does not split over dp {layout.dp}"))
            continue
        if layout.pp > 1 and least_compute is not None and fastest is not None:
            microbatches = batches[0] // facts["microbatch_size"]
            bound = least_compute * global_batch * facts["seq_len"] / world_size * (microbatches + layout.pp - 1) / microbatches
            if bound >= fastest:
                result.outcomes.append(Outcome(Candidate(layout, batches[0], "-", global_batch), pruned=(
                    f"its compute alone with the bubble ({bound:.2f} s) is no faster than {fastest:.2f} s")))
                continue
        for local_batch in batches:
            fitted = None
            for ac in AC_MODES:
                candidate = Candidate(layout, local_batch, ac, global_batch)
                progress(f"planning {candidate.describe()}")
                try:
                    job_plan = plan(candidate.argv(argv), candidate)
                except PlanError as exc:
                    result.outcomes.append(Outcome(candidate, refused=str(exc).splitlines()[0]))
                    break  # torchtitan refuses the layout itself, whatever the mode
                result.outcomes.append(Outcome(candidate, job_plan))
                per_token = job_plan.timing.compute_s * world_size / job_plan.tokens_per_step
                least_compute = per_token if least_compute is None else min(least_compute, per_token)
                if job_plan.fits:
                    fitted = ac
                    fastest = job_plan.step_s if fastest is None else min(fastest, job_plan.step_s)
                    break
            else:
                continue  # nothing fits this batch: try a smaller one
            if fitted is None or fitted == "none":
                break  # refused, or fits without recomputation: a smaller batch is only slower
    fitting = result.fitting()
    if full is not None:
        for outcome in fitting[:3]:
            progress(f"planning {outcome.candidate.describe()} at full depth")
            confirmed = full(outcome.candidate.argv(argv), outcome.candidate)
            if confirmed.fits:
                result.best, result.best_shallow = confirmed, outcome.plan
                break
    result.seconds = time.monotonic() - started
    return result


def flags_text(candidate: Candidate) -> str:
    return " ".join([*candidate.flags(), f"activation-checkpoint:{candidate.ac}"])

