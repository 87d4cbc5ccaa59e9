"""npu-inject plan --expert-load: the busiest expert-parallel rank's share, from a ratio or from router counts."""

import json

import pytest

from npu_inject.errors import ConfigError
from npu_inject.planner import expert_load
from npu_inject.planner.config import PlanError


def test_a_ratio_is_taken_as_given_and_refused_below_one():
    assert expert_load.parse("1.3").ratio(ep=8, experts=64) == 1.3
    assert expert_load.parse(None).ratio(ep=8, experts=64) == 1.0
    with pytest.raises(ConfigError, match="at least 1"):
        expert_load.parse("0.9")
    with pytest.raises(ConfigError, match="neither a number"):
        expert_load.parse("/nonexistent/counts.json")


def test_router_counts_give_the_largest_contiguous_block_over_the_mean_at_the_planned_degree(tmp_path):
    """8 experts, two layers: at EP 2 the blocks are experts 0-3 and 4-7, at EP 4 pairs; the layers' ratios are
    averaged (each layer waits for its own busiest rank)."""
    layers = [[10, 10, 10, 10, 10, 10, 10, 50], [30, 10, 10, 10, 10, 10, 10, 10]]
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"tokens_per_expert": layers}))
    load = expert_load.parse(str(path))
    # EP 2: layer 0 blocks 40 and 80 (mean 60): 4/3; layer 1 60 and 40 (mean 50): 6/5.
    assert load.ratio(ep=2, experts=8) == pytest.approx((80 / 60 + 60 / 50) / 2)
    # EP 4: layer 0 blocks 20, 20, 20, 60 (mean 30): 2; layer 1 40, 20, 20, 20 (mean 25): 1.6.
    assert load.ratio(ep=4, experts=8) == pytest.approx((2.0 + 1.6) / 2)
    with pytest.raises(PlanError, match="counts 8 experts, the model routes to 16"):
        load.ratio(ep=2, experts=16)


def test_malformed_counts_are_one_line(tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps([[1, -2]]))
    with pytest.raises(ConfigError, match="non-negative"):
        expert_load.parse(str(path))


def test_the_busiest_rank_receives_the_ratio_times_the_balanced_rows_in_whole_rows():
    splits = expert_load.receive_splits(rows=1000, ep=4, ratio=1.5)
    assert sum(splits) == 1500 and max(splits) - min(splits) <= 1
    assert expert_load.receive_splits(rows=10, ep=4, ratio=1.0) == [3, 3, 2, 2]


def test_deepseeks_v2_lite_routing_logs_give_the_published_rows_ratios():
    """docs/measured's counts of DeepSeek's ESFT routing logs: the busiest of 8 contiguous blocks of 8 experts over
    the mean block, each of the 26 layers', averaged: 1.27 pooled (tools/bench_plan.py's row plans the file) and
    1.69 for the translation domain alone (the row's given ratio)."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "measured", "esft_v2_lite_router_counts.json")
    document = json.loads(open(path, encoding="utf-8").read())

    def busiest_of_8(layers):
        ratios = []
        for counts in layers:
            blocks = [sum(counts[start:start + 8]) for start in range(0, 64, 8)]
            ratios.append(max(blocks) * 8 / sum(blocks))
        return sum(ratios) / len(ratios)

    assert len(document["tokens_per_expert"]) == 26 and all(len(layer) == 64 for layer in document["tokens_per_expert"])
    assert expert_load.parse(path).ratio(ep=8, experts=64) == pytest.approx(busiest_of_8(document["tokens_per_expert"]))
    assert busiest_of_8(document["tokens_per_expert"]) == pytest.approx(1.27, abs=0.005)
    assert busiest_of_8(document["by_domain"]["translation"]) == pytest.approx(1.69, abs=0.005)
    assert max(busiest_of_8(document["by_domain"][domain]) for domain in ("intent", "law", "summary")) < 1.69
