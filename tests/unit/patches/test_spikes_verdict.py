"""spikes' verdict against hand-computed medians and deviations, and its one bad-input line."""

from __future__ import annotations

import pytest

from npu_inject import module_facts
from npu_inject.errors import RunStopped
from npu_inject.patches import spikes
from npu_inject.patching import PatchContext

QUIET = [1.0, 1.1, 0.9, 1.05, 0.95]  # median 1.0, median absolute deviation 0.05: sigma 0.07413
NOISY = [1.0, 2.0, 3.0, 4.0, 5.0]  # median 3.0, median absolute deviation 1.0: sigma 1.4826


@pytest.mark.parametrize("value, window, spike", [
    (3.5, QUIET, True),  # 3.5x the median, (3.5 - 1) / 0.07413 = 33.7 deviations
    (2.9, QUIET, False),  # 39 deviations, but under 3x the median
    (9.5, NOISY, False),  # 3.2x the median, but (9.5 - 3) / 1.4826 = 4.4 deviations
    (15.0, NOISY, True),  # 5x, 8.1 deviations
    (3.1, [1.0] * 5, True),  # a window without spread: any value past the ratio
])
def test_a_spike_is_past_both_the_ratio_and_the_deviations(value, window, spike):
    verdict = spikes.spike_verdict(value, window, ratio=3.0, threshold=8.0)
    assert (verdict is not None) == spike, verdict
    if spike:
        assert verdict.startswith(f"gradient norm spike: {value:.4g} is ")


def test_a_warmup_longer_than_the_window_stops_at_start_up_naming_both():
    ctx = PatchContext(patch_id="spikes", device_kind="cpu", declared_targets=module_facts.declared_names(spikes),
                       options={"watch": "both", "window": 5, "warmup": 6, "ratio": 3.0, "loss_ratio": 1.5,
                                "threshold": 8.0, "stop_after": 3})
    with pytest.raises(RunStopped, match=r"warmup=6 is more than window=5: no step would ever be judged"):
        spikes.apply(ctx)


def test_a_loss_spike_is_named_as_one_and_judged_by_the_loss_ratio():
    falling = [4.2, 4.1, 4.0, 3.9, 3.8]  # median 4.0, median absolute deviation 0.1: sigma 0.14826
    assert spikes.spike_verdict(5.5, falling, ratio=1.5, threshold=8.0, what="loss") is None  # 1.375x
    verdict = spikes.spike_verdict(6.5, falling, ratio=1.5, threshold=8.0, what="loss")
    assert verdict.startswith("loss spike: 6.5 is 1.6x the median 4 of the last 5 applied steps, 16.9 deviations")


@pytest.mark.parametrize("holds, shares, mesh, expected", [
    (True, [0.25, 0.5], 1, 0.75),  # one rank, two microbatches: their sum
    (False, [], 1, None),  # a non-last pipeline stage alone has no loss: 0 / 0
])
def test_a_single_process_loss_is_the_sum_of_its_shares(holds, shares, mesh, expected):
    import math

    import torch

    loss = spikes.loss_of_the_step([torch.tensor(x) for x in shares], holds, mesh, torch.device("cpu"))
    assert (math.isnan(loss.item()) if expected is None else loss.item() == expected)
