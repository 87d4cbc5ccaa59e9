"""Planning a deep model from shallow copies of it: the same job with fewer layers, extrapolated.

A decoder's layers repeat: after a prefix (DeepSeek-V3's dense layers), one block of ``period`` layers
(one MoE layer; a dense and a MoE layer where they alternate) recurs to the end. Memory and time per
step grow by the same amount with each repeat on a rank, so the planner records the job with
``units`` repeats on every pipeline stage for two values of ``units`` and extrapolates each quantity
along the line through them to the repeats the real stages hold. Each shallow stage keeps the prefix
layers its real counterpart holds (pipeline splits are set explicitly, as torchtitan's
``module_fqns_per_model_part`` allows), so only alike layers are dropped.

What this assumes: a stage's cost is linear in its repeats (true of parameters, gradients, optimizer
states and per-layer activations, not of the caching allocator's cache beyond them, which is taken as the
shallow copies leave it); the pipeline's step time is set by the stage with the most repeats.
``npu-inject plan --search`` plans every layout this way and the best one again at full depth, printing how
far apart they are.

Peak memory is not one such line: the peak sits in the backward of some repeat, and which one changes with depth.
So each place's peak (a prefix layer, the two repeats at either end of a stage, the other modules) gets its own
line, and the highest at full depth is the plan's (``job.peak_at_depth``). With FSDP a repeat's peak also holds
its neighbours, the next repeat's gradients waiting for their reduce-scatter and the previous one's parameters
gathered ahead, so the copies keep at least three repeats (:data:`SHALLOW_UNITS`): then the second repeat from
either end has a repeat on each side in both copies. With one and two, as the planner recorded before, the first
increment carried a neighbour's bytes which the line multiplied: deepseek_v3_671b on 1024 ranks with EP 2 (10.5
GiB of experts per layer unsharded) grew 22.1 GiB from one repeat to two, 13.6 from two to three, 7.6 from three
to four and 7.6 a repeat on average from there to its 58; it was planned at 1.2 TiB, 0.5 at full depth.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass
from typing import Any

# The fewer repeats of the block per stage a shallow plan records (and one more): the fewest for which the repeats
# next to a stage's ends have their FSDP neighbours in both copies (module docstring).
SHALLOW_UNITS = 3


@dataclass(frozen=True)
class Shape:
    layers: int  # the model's layers
    prefix: int  # layers before the repeating block
    period: int  # layers in the repeating block
    stages: tuple[tuple[str, ...], ...]  # the full model's module names per pipeline stage
    stages_per_rank: int

    def units(self, stage: int) -> float:
        """Repeats of the block in ``stage`` of the full model."""
        held = [int(name.split(".")[1]) for name in self.stages[stage] if name.startswith("layers.")]
        return sum(1 for index in held if index >= self.prefix) / self.period

    def rank_units(self, pp_rank: int, pp: int) -> float:
        """Mean repeats per stage of the stages pipeline rank ``pp_rank`` holds (looped or V order)."""
        held = [stage for stage in range(len(self.stages)) if _rank_of_stage(stage, pp, len(self.stages)) == pp_rank]
        return sum(self.units(stage) for stage in held) / max(len(held), 1)


def _rank_of_stage(stage: int, pp: int, stages: int) -> int:
    # torchtitan's stage_ids_this_rank: "loop" for most schedules, "v" for ZBV/DualPipeV; looped is
    # what matters here (which stages a rank holds only changes which repeats it holds, all alike).
    return stage % pp


def _kind(layer) -> tuple:
    """What a layer is: its config's type and which kind of module fills each field."""
    if dataclasses.is_dataclass(layer):
        return (type(layer).__name__, *((f.name, type(getattr(layer, f.name)).__name__)
                                        for f in dataclasses.fields(layer)))
    return (type(layer).__name__,)


def repeating_block(layers: list) -> tuple[int, int] | None:
    """(prefix, period) of the shortest description "prefix, then one block repeated to the end", the
    block repeating at least twice; None when the layers have no such shape."""
    kinds = [_kind(layer) for layer in layers]
    best = None
    for period in range(1, 5):
        for prefix in range(len(kinds)):
            tail = kinds[prefix:]
            if len(tail) < 2 * period:
                break
            if all(tail[i] == tail[i % period] for i in range(len(tail))):
                if best is None or prefix + period < sum(best):
                    best = (prefix, period)
                break
    return best


def shape(config) -> Shape | None:
    """The repeating shape of the job's model and pipeline, or None when it cannot be reduced."""
    from torchtitan.distributed import pipeline_parallel

    model = config.model_spec.model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        return None
    block = repeating_block(layers)
    if block is None:
        return None
    parallelism = config.parallelism
    pp = parallelism.pipeline_parallel_degree
    if pp > 1:
        stages, _, input_weight, output_weight = pipeline_parallel._get_pipeline_metadata(
            types.SimpleNamespace(pp=pp), parallelism, model)
        names = parallelism.module_fqns_per_model_part or pipeline_parallel._generate_llm_fqn_per_model_part(
            stages, len(layers), input_weight, output_weight)
    else:
        stages, names = 1, [["tok_embeddings", *(f"layers.{i}" for i in range(len(layers))), "norm", "lm_head"]]
    return Shape(len(layers), *block, tuple(tuple(stage) for stage in names), len(names) // pp)


def reduce(config, layout: Shape, units: int) -> None:
    """Give ``config`` ``units`` repeats of the block per pipeline stage, each stage keeping its prefix layers."""
    model = config.model_spec.model
    layers = model.layers
    block = layers[layout.prefix:layout.prefix + units * layout.period]
    if len(block) < units * layout.period:
        raise ValueError(f"the model has fewer than {units} repeats of its block to keep")
    new_layers: list = []
    new_stages: list[list[str]] = []
    for stage in layout.stages:
        names = []
        held = [int(name.split(".")[1]) for name in stage if name.startswith("layers.")]
        kept = [layers[i] for i in held if i < layout.prefix] + (list(block) if held or len(layout.stages) == 1 else [])
        for position, name in enumerate(stage):
            if not name.startswith("layers."):
                names.append(name)
            elif position == next(i for i, n in enumerate(stage) if n.startswith("layers.")):
                names.extend(f"layers.{len(new_layers) + i}" for i in range(len(kept)))
        new_layers.extend(kept)
        new_stages.append(names)
    model.layers = new_layers
    if len(layout.stages) > 1:
        config.parallelism.module_fqns_per_model_part = new_stages
        config.parallelism.pipeline_parallel_layers_per_stage = None


def shallow_places(layout: Shape, units: int) -> dict[int, tuple]:
    """Where each layer of the copy :func:`reduce` makes with ``units`` repeats per stage stands, by its index there:
    ``("prefix", its index in the full model)`` or ``("repeat", stage, repeat, place in the block)``."""
    places: dict[int, tuple] = {}
    for stage, names in enumerate(layout.stages):
        held = [int(name.split(".")[1]) for name in names if name.startswith("layers.")]
        for index in held:
            if index < layout.prefix:
                places[len(places)] = ("prefix", index)
        if held or len(layout.stages) == 1:  # as reduce() gives every stage that holds layers the block
            for repeat in range(units):
                for offset in range(layout.period):
                    places[len(places)] = ("repeat", stage, repeat, offset)
    return places


def extrapolate(shallow: float, deeper: float, units: tuple[int, int], target: float) -> float:
    """The value at ``target`` repeats on the line through (units[0], shallow) and (units[1], deeper)."""
    slope = (deeper - shallow) / (units[1] - units[0])
    return shallow + (target - units[0]) * slope


def describe(layout: Shape) -> dict[str, Any]:
    return {"layers": layout.layers, "prefix": layout.prefix, "period": layout.period,
            "stages": len(layout.stages), "units_per_stage": [layout.units(s) for s in range(len(layout.stages))],
            "max_units": max(math.ceil(layout.units(s)) for s in range(len(layout.stages)))}
