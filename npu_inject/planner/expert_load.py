"""How unevenly the experts' tokens fall on the expert-parallel ranks: ``npu-inject plan --expert-load``.

The slowest expert-parallel rank sets the pace of an MoE layer: its grouped matmuls run on the most rows, its
all-to-all receives the most, and its memory holds the most. The planner plans that rank: the rows it receives
are the balanced share (tokens x top_k / ep from each peer) times the load ratio, the busiest rank's tokens over
the mean rank's. The ratio comes from

* a number (``--expert-load 1.3``), the ratio itself; or
* a JSON file of router counts, tokens per expert (a list for one layer, a list of lists for several, or an object
  whose ``tokens_per_expert`` holds either): torchtitan keeps them per MoE layer as ``moe.tokens_per_expert_E`` (the
  load-balancing bias update reads them), a rehearsal's or a real run's. Experts sit on the expert-parallel ranks
  in contiguous blocks (torchtitan's sharding of the expert dimension), so a layer's ratio is its largest block's
  sum over its mean block's, at the planned expert-parallel degree. The plan takes the mean of the layers' ratios:
  each MoE layer waits at its all-to-all for its own busiest rank, so the step's expert time is the sum of each
  layer's busiest rank's, and no rank holds more of the layers' activations than that sum (another layer's
  busiest rank may be another rank);
* without the flag, 1 (balanced): no public per-rank figure for torchtitan's routers was found to stand as a
  default (docs/planner.md says what a measured one changes).

Stdlib only: the command validates the flag before any worker starts; the recordings read it from
:data:`ENV`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from npu_inject.errors import ConfigError

ENV = "NPU_INJECT_PLAN_EXPERT_LOAD"


@dataclass(frozen=True)
class ExpertLoad:
    given: float | None = None  # --expert-load R
    counts: tuple[tuple[float, ...], ...] = ()  # tokens per expert, per layer (--expert-load FILE)
    source: str = "balanced (no --expert-load)"

    def ratio(self, ep: int, experts: int) -> float:
        """The busiest of ``ep`` ranks' tokens over the mean rank's, for a model of ``experts`` routed experts."""
        if self.given is not None:
            return self.given
        if not self.counts or ep <= 1:
            return 1.0
        ratios = []
        for layer, counts in enumerate(self.counts):
            if len(counts) != experts:
                from npu_inject.planner.config import PlanError

                raise PlanError(f"--expert-load {self.source}: layer {layer} counts {len(counts)} experts, the "
                                  f"model routes to {experts}; give one count per routed expert")
            per_rank = len(counts) // ep
            blocks = [sum(counts[rank * per_rank:(rank + 1) * per_rank]) for rank in range(ep)]
            mean = sum(blocks) / ep
            ratios.append(max(blocks) / mean if mean > 0 else 1.0)  # a layer that routed nothing waits for no one
        return sum(ratios) / len(ratios)


def parse(value: str | None) -> ExpertLoad:
    """``--expert-load``'s value, checked: a ratio of at least 1, or a JSON file of tokens per expert."""
    if not value:
        return ExpertLoad()
    try:
        ratio = float(value)
    except ValueError:
        ratio = None
    if ratio is not None:
        if not ratio >= 1.0:
            raise ConfigError(f"--expert-load {value}: the busiest expert-parallel rank's tokens over the mean rank's "
                              "is at least 1 (1: balanced)")
        return ExpertLoad(given=ratio, source=f"--expert-load {value}")
    if not os.path.isfile(value):
        raise ConfigError(f"--expert-load {value}: neither a number (the busiest rank's tokens over the mean's, >= 1) "
                          "nor a JSON file of tokens per expert")
    try:
        with open(value, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--expert-load {value}: cannot read it as JSON ({exc})") from None
    if isinstance(document, dict):
        document = document.get("tokens_per_expert")
    layers = document if document and isinstance(document[0], list) else [document]
    if not isinstance(document, list) or not all(
            isinstance(layer, list) and layer and all(isinstance(n, (int, float)) and n >= 0 for n in layer)
            for layer in layers):
        raise ConfigError(f"--expert-load {value}: expected tokens per expert, non-negative numbers: a list (one "
                          "layer), a list of lists (one per layer), or an object with tokens_per_expert")
    return ExpertLoad(counts=tuple(tuple(float(n) for n in layer) for layer in layers),
                      source=f"--expert-load {value} ({len(layers)} layer(s) of router counts)")


def from_environment() -> ExpertLoad:
    """The load the recording's planner was given (:data:`ENV`, set by the command)."""
    return parse(os.environ.get(ENV))


def receive_splits(rows: int, ep: int, ratio: float) -> list[int]:
    """What the planned (busiest) rank receives from each of ``ep`` peers when every rank routes ``rows`` rows
    (tokens x top_k): ``ratio`` times the balanced share in all, spread as evenly as whole rows allow."""
    total = round(rows * ratio)
    return [total // ep + (1 if peer < total % ep else 0) for peer in range(ep)]
