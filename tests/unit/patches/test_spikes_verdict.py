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
                       options={"window": 5, "warmup": 6, "ratio": 3.0, "threshold": 8.0, "stop_after": 3})
    with pytest.raises(RunStopped, match=r"warmup=6 is more than window=5: no step would ever be judged"):
        spikes.apply(ctx)
