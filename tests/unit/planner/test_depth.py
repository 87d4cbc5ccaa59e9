"""A deep model's peak memory from shallow copies of it: which copies, and how their peaks are extrapolated.

The stage's memory here is a model of FSDP's backward written for this test, in GiB, with the sizes the planner
recorded for deepseek_v3_671b on 1024 ranks: at the backward of the j-th of U repeats of the MoE block live the
parameters and optimizer states of all U repeats (STATES each), the inputs every repeat before it saved, the
repeat's own transient, and its FSDP neighbours: the next repeat's gradients waiting for their reduce-scatter (the
norm's, small, after the last repeat) and the previous repeat's parameters gathered ahead (a dense prefix layer's,
small, before the first).
"""

from __future__ import annotations

from npu_inject.planner import depth, job

GIB = 2**30
LAYERS, PREFIX = 61, 3
SHAPE = depth.Shape(LAYERS, PREFIX, 1, (("tok_embeddings", *(f"layers.{i}" for i in range(LAYERS)), "norm", "lm_head"),), 1)

# EP 2, selective AC: 10.5 GiB of experts per layer unsharded, 21.9 of their gradients.
EP2 = dict(base=10.0, states=0.13, saved=7.5, own=21.0, first_extra=0.0, next_gradients=21.9, previous_parameters=10.5)
# EP 256, full AC: each repeat saves its input (0.22 GiB); the first MoE layer's all-to-all buffers are 0.56 larger.
EP256 = dict(base=21.0, states=0.13, saved=0.22, own=0.0, first_extra=0.56, next_gradients=0.0, previous_parameters=0.0)
SMALL = 0.2


def _at_backward(sizes: dict, repeats: int, j: int) -> float:
    return (sizes["base"] + sizes["states"] * repeats + sizes["saved"] * (j - 1) + sizes["own"]
            + (sizes["first_extra"] if j == 1 else 0.0)
            + (sizes["next_gradients"] if j < repeats else SMALL) + (sizes["previous_parameters"] if j > 1 else SMALL))


def _peak(sizes: dict, repeats: int) -> float:
    return max(_at_backward(sizes, repeats, j) for j in range(1, repeats + 1))


def _copy(sizes: dict, repeats: int) -> job.RolePlan:
    """What the planner records of the copy with ``repeats``: the most allocated during each module's operators."""
    by_module = {f"layers.{i}": SMALL for i in range(PREFIX)}
    by_module.update({f"layers.{PREFIX + j - 1}": _at_backward(sizes, repeats, j) * GIB for j in range(1, repeats + 1)})
    by_module.update(loss=SMALL, optimizer=sizes["base"] * GIB)
    return job.RolePlan(0, 0, int(_peak(sizes, repeats) * GIB), int(_peak(sizes, repeats) * GIB), 0, 0, {}, [], 0,
                        peak_by_module=by_module)


def _planned(sizes: dict, units: tuple[int, int]) -> float:
    return job.peak_at_depth(_copy(sizes, units[0]), _copy(sizes, units[1]), SHAPE, units, LAYERS - PREFIX) / GIB


def test_the_shallow_plan_finds_the_full_depth_peak_wherever_it_moves():
    units = (depth.SHALLOW_UNITS, depth.SHALLOW_UNITS + 1)  # as job.submit records them
    for sizes in (EP2, EP256):
        assert abs(_planned(sizes, units) - _peak(sizes, LAYERS - PREFIX)) < 1e-6, sizes


def test_the_line_through_the_copies_peaks_missed_it_both_ways():
    """What the planner did before: one line through the two copies' peaks. With one and two repeats the first has
    no neighbour of its kind (EP 2: planned 2.6x the full depth's peak); with three and four the peak still sits in
    the first repeat's backward (EP 256: planned 16% low here, 22% in the planner's recordings)."""
    def line(sizes, units):
        return depth.extrapolate(_peak(sizes, units[0]), _peak(sizes, units[1]), units, LAYERS - PREFIX)

    assert line(EP2, (1, 2)) > 2 * _peak(EP2, LAYERS - PREFIX)
    assert line(EP256, (3, 4)) < 0.9 * _peak(EP256, LAYERS - PREFIX)
