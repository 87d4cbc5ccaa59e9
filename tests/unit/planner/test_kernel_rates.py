"""Measured kernel rates: parsed strictly, looked up by shape, and used by the cost model in place of fractions."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from npu_inject import hardware, kernel_rates
from npu_inject.errors import ConfigError
from npu_inject.planner import costmodel

SOURCE = "measured 2026-11-26 on a test device"


def _grid(values):
    """Matmul points of a 2 x 2 x 2 grid, TFLOP/s from ``values(m, n, k)``."""
    return [{"dtype": "bf16", "m": m, "n": n, "k": k, "tflops": values(m, n, k), "source": SOURCE}
            for m in (128, 2048) for n in (128, 2048) for k in (128, 2048)]


def _rates(**extra):
    raw = {"about": SOURCE, "matmul": _grid(lambda m, n, k: 100.0 + m / 128 + n / 64 + k / 32), **extra}
    return kernel_rates.parse("test.rates", raw)


def test_a_grid_point_is_its_measurement_and_between_points_interpolates_in_log2():
    rates = _rates()
    assert rates.matmul_tflops("bf16", 2048, 128, 2048) == pytest.approx(100 + 16 + 2 + 64)
    # Halfway in log2 along m (512 = sqrt(128 * 2048)): the mean of the two measured ends.
    low, high = 100 + 1 + 2 + 4, 100 + 16 + 2 + 4
    assert rates.matmul_tflops("bf16", 512, 128, 128) == pytest.approx((low + high) / 2)
    # Beyond the grid: the nearest edge, not an extrapolation.
    assert rates.matmul_tflops("bf16", 1 << 20, 128, 128) == pytest.approx(high)
    # Another dtype without a grid takes bf16's.
    assert rates.matmul_tflops("fp32", 2048, 128, 2048) == pytest.approx(100 + 16 + 2 + 64)


def test_a_grid_with_a_hole_is_refused_naming_the_missing_point():
    points = _grid(lambda m, n, k: 100.0)[:-1]
    with pytest.raises(ConfigError, match=r"test.rates.matmul: the bf16 points are not a full grid .*1 missing, "
                                          r"e.g. m=2048 n=2048 k=2048"):
        kernel_rates.parse("test.rates", {"about": SOURCE, "matmul": points})


@pytest.mark.parametrize("value", [0, -3.0, float("inf"), float("nan"), True, "fast"])
def test_a_rate_must_be_a_positive_finite_number(value):
    points = _grid(lambda m, n, k: 100.0)
    points[3]["tflops"] = value
    with pytest.raises(ConfigError, match=r"test.rates.matmul\[3\].tflops must be a finite number above 0"):
        kernel_rates.parse("test.rates", {"about": SOURCE, "matmul": points})


def test_every_point_says_where_it_comes_from():
    points = _grid(lambda m, n, k: 100.0)
    del points[0]["source"]
    with pytest.raises(ConfigError, match=r"test.rates.matmul\[0\].source must say where"):
        kernel_rates.parse("test.rates", {"about": SOURCE, "matmul": points})


def test_attention_by_kernel_direction_and_length_and_the_planned_kernel_must_be_measured():
    points = [{"kernel": "fa", "direction": direction, "causal": True, "head_dim": 128, "seq": seq, "tflops": tflops,
               "source": SOURCE} for direction, seq, tflops in
              (("forward", 1024, 200.0), ("forward", 4096, 400.0), ("backward", 1024, 100.0))]
    rates = _rates(attention=points, attention_kernel="fa")
    assert rates.attention_tflops("forward", 2048, 128, True) == pytest.approx(300.0)
    assert rates.attention_tflops("backward", 99999, 128, True) == pytest.approx(100.0)
    with pytest.raises(ConfigError, match=r"attention_kernel 'other' is not a measured kernel \(measured: fa\)"):
        _rates(attention=points, attention_kernel="other")


def _ranged_attention(forward=(200.0, [150.0, 250.0]), backward=(100.0, None)):
    points = []
    for direction, (tflops, bounds) in (("forward", forward), ("backward", backward)):
        point = {"kernel": "fa", "direction": direction, "causal": True, "head_dim": 128, "seq": 4096,
                 "tflops": tflops, "source": SOURCE}
        if bounds is not None:
            point["range"] = bounds
        points.append(point)
    return points


def test_an_attention_point_may_carry_its_sources_range_and_the_rates_take_either_end():
    rates = _rates(attention=_ranged_attention(), attention_kernel="fa")
    assert rates.attention_ranged
    assert rates.attention_tflops("forward", 4096, 128, True) == 200.0
    slow, fast = rates.at_attention_end("low"), rates.at_attention_end("high")
    assert slow.attention_tflops("forward", 4096, 128, True) == 150.0
    assert fast.attention_tflops("forward", 4096, 128, True) == 250.0
    # A point without a range is its own two ends; the ends carry no range of their own.
    assert slow.attention_tflops("backward", 4096, 128, True) == fast.attention_tflops("backward", 4096, 128, True) == 100.0
    assert not slow.attention_ranged
    assert not _rates(attention=_ranged_attention(forward=(200.0, None)), attention_kernel="fa").attention_ranged
    with pytest.raises(ValueError, match="end must be 'low' or 'high'"):
        rates.at_attention_end("middle")


@pytest.mark.parametrize("bounds, message", [
    ([250.0, 150.0], r"test.rates.attention\[0\].range \[250, 150\] must hold its tflops 200"),
    ([210.0, 250.0], r"test.rates.attention\[0\].range \[210, 250\] must hold its tflops 200"),
    ([150.0], r"test.rates.attention\[0\].range must be \[low, high\] in TFLOP/s"),
    ([0.0, 250.0], r"test.rates.attention\[0\].range\[0\] must be a finite number above 0"),
])
def test_a_range_that_does_not_hold_its_point_is_refused_naming_the_point(bounds, message):
    with pytest.raises(ConfigError, match=message):
        _rates(attention=_ranged_attention(forward=(200.0, bounds)), attention_kernel="fa")


def test_the_plan_times_attention_at_either_end_of_its_range():
    """Attention's time at the slow and fast ends over its time at the rates: the rates' ratio where the kernels
    are compute-bound (a 4096-token causal forward of 1 TFLOP at 200, 150 and 250 TFLOP/s)."""
    rates = _rates(attention=_ranged_attention(), attention_kernel="fa")
    profile = hardware.load().find("Ascend910B2")
    profile = replace(profile, rates=rates)
    eff = {"kernel_us": 1.0, "memory": 1.0, "cube": 0.1, "attention": 0.1, "host_us": 1.0}
    forward = SimpleNamespace(kind="compute", name="npu_inject.npu_fusion_attention", flops=1e12, bytes=0,
                              dtype="bfloat16", shape=(4096, 128, True))
    matmul = _op("aten.mm", 1e12, 0, (2048, 2048, 2048))
    trace = SimpleNamespace(ops=[matmul, forward, matmul])
    ratio = costmodel.attention_rate_range({0: trace}, profile, eff, {0: (0, 3)})
    assert ratio == pytest.approx({"slow": 200 / 150, "fast": 200 / 250})
    # Rates measured on the machine carry no range: nothing to print.
    assert costmodel.attention_rate_range({0: trace}, replace(profile, rates=_rates()), eff, {0: (0, 3)}) is None
    # A window without attention has no ratio.
    assert costmodel.attention_rate_range({0: trace}, profile, eff, {0: (0, 1)}) is None


def test_the_packaged_ascend_attention_points_hold_their_sources_spans():
    """tools/make_ascend_rates.py's 32K forward, full mask: the point 0.46 of the 910B2's peak within 0.39 (the
    training kernel at 10 heads, WAN) to 0.49 (PTO's 910B2 watermark); the backward's range 0.76-0.95 of those."""
    profile = hardware.load().find("Ascend910B2")
    peak = profile.peak("bf16") / 1e12
    slow, fast = (profile.rates.at_attention_end(end) for end in ("low", "high"))
    assert profile.rates.attention_tflops("forward", 32768, 128, False) == pytest.approx(0.46 * peak, rel=1e-3)
    assert slow.attention_tflops("forward", 32768, 128, False) == pytest.approx(0.39 * peak, rel=1e-3)
    assert fast.attention_tflops("forward", 32768, 128, False) == pytest.approx(0.49 * peak, rel=1e-3)
    assert slow.attention_tflops("backward", 32768, 128, False) == pytest.approx(0.76 * 0.39 * peak, rel=1e-3)
    assert fast.attention_tflops("backward", 32768, 128, False) == pytest.approx(0.95 * 0.49 * peak, rel=1e-3)


def _op(name, flops, nbytes, shape=(), dtype="bfloat16"):
    return SimpleNamespace(kind="compute", name=name, flops=flops, bytes=nbytes, dtype=dtype, shape=shape)


def test_the_cost_model_times_a_matmul_at_its_measured_rate_not_the_family_fraction():
    rates = _rates()
    profile = SimpleNamespace(rates=rates, memory_bandwidth_gbps=1000.0, vector_tflops=10.0, peak=lambda dtype: 1e15)
    eff = {"kernel_us": 1.0, "memory": 1.0, "cube": 0.1, "attention": 0.1}
    flops = 2.0 * 2048 * 2048 * 2048
    seconds = costmodel.op_seconds(_op("aten.mm", flops, 3 * 2048 * 2048 * 2, (2048, 2048, 2048)), profile, eff)
    assert seconds == pytest.approx(flops / ((100 + 16 + 32 + 64) * 1e12))
    # The same operator without rates: the family's fraction of the peak (0.1 x 1 PFLOP/s).
    plain = SimpleNamespace(rates=None, memory_bandwidth_gbps=1000.0, vector_tflops=10.0, peak=lambda dtype: 1e15)
    assert costmodel.op_seconds(_op("aten.mm", flops, 0, (2048, 2048, 2048)), plain, eff) == pytest.approx(flops / 1e14)


def test_memory_bound_kernels_take_the_measured_bandwidth_of_their_size_and_dtype():
    memory = [{"op": "add", "dtype": "bf16", "bytes": size, "gbps": gbps, "source": SOURCE}
              for size, gbps in ((1 << 10, 10.0), (1 << 30, 1000.0))]
    rates = _rates(memory=memory)
    profile = SimpleNamespace(rates=rates, memory_bandwidth_gbps=5000.0, vector_tflops=10.0, peak=lambda dtype: 1e15)
    eff = {"kernel_us": 0.0, "memory": 1.0}
    seconds = costmodel.op_seconds(_op("aten.add.Tensor", 0, 1 << 20), profile, eff)
    gbps = 10.0 + (1000.0 - 10.0) * (10 / 20)  # 2^20 is halfway between 2^10 and 2^30 in log2
    assert seconds == pytest.approx((1 << 20) / (gbps * 1e9))


def test_a_profile_may_name_a_rates_file_beside_it_and_its_errors_name_that_file(tmp_path):
    raw = json.load(open(hardware.PACKAGED))
    mine = dict(raw["profiles"]["Ascend910B2"], rates="mine_rates.json")
    (tmp_path / "mine.json").write_text(json.dumps({"profiles": {"Mine": mine}}))
    (tmp_path / "mine_rates.json").write_text(json.dumps({"about": SOURCE, "host_us": {"value": -1, "source": SOURCE}}))
    with pytest.raises(ConfigError, match=r"mine_rates\.json\.host_us\.value must be a finite number above 0"):
        hardware.load(str(tmp_path / "mine.json"))
    (tmp_path / "mine_rates.json").write_text(json.dumps({"about": SOURCE, "host_us": {"value": 7.5, "source": SOURCE}}))
    assert hardware.load(str(tmp_path / "mine.json")).find("Mine").rates.host_us == 7.5


@pytest.mark.parametrize("key, value, message", [
    ("memory_bandwidth_gbps", -1600, r"memory_bandwidth_gbps: -1600 is not a positive finite number"),
    ("memory_bandwidth_gbps", 0, r"memory_bandwidth_gbps: 0 is not a positive finite number"),
    ("memory_gib", float("inf"), r"memory_gib: inf is not a positive finite number"),
])
def test_a_bad_hardware_number_is_refused_naming_the_file_and_key(tmp_path, key, value, message):
    raw = json.load(open(hardware.PACKAGED))
    mine = dict(raw["profiles"]["Ascend910B2"])
    mine[key] = {"value": value, "source": "mine"}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"profiles": {"Bad": mine}}))
    with pytest.raises(ConfigError, match=r"bad\.json: profile 'Bad'\." + message):
        hardware.load(str(path))


def test_a_negative_link_bandwidth_is_refused(tmp_path):
    raw = json.load(open(hardware.PACKAGED))
    mine = json.loads(json.dumps(raw["profiles"]["Ascend910B2"]))
    mine["scale_out"]["bandwidth_gbps"]["value"] = -25
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"profiles": {"Bad": mine}}))
    with pytest.raises(ConfigError, match=r"profile 'Bad'\.scale_out\.bandwidth_gbps: -25 is not a positive"):
        hardware.load(str(path))


def test_the_packaged_measured_profile_reaches_what_its_measurements_say():
    """H100-SXM's rates (npu-inject calibrate on a real H100): a large bf16 matmul near the 0.75-0.8 of the
    989 TFLOP/s peak the device showed, far above the old fitted 0.416."""
    profile = hardware.load().find("H100")
    tflops = profile.rates.matmul_tflops("bf16", 16384, 4096, 4096)
    assert 0.6 * 989 < tflops < 0.9 * 989
    assert math.isfinite(profile.rates.host_us) and profile.rates.host_us > 0


def test_the_trace_records_a_matrix_kernels_shape_as_its_rate_is_looked_up():
    """(M, N, K) of C[M, N] = A[M, K] @ B[K, N]; a batched product's batch as more rows; a grouped product per group."""
    import torch

    from npu_inject.planner.trace import _kernel_shape

    aten = torch.ops.aten
    a_MK, b_KN = torch.empty(8, 4), torch.empty(4, 2)
    assert _kernel_shape(aten.mm.default, (a_MK, b_KN), {}) == (8, 2, 4)
    assert _kernel_shape(aten.addmm.default, (torch.empty(2), a_MK, b_KN), {}) == (8, 2, 4)
    assert _kernel_shape(aten.bmm.default, (torch.empty(3, 8, 4), torch.empty(3, 4, 2)), {}) == (24, 2, 4)
    rows_RK, weights_GKN = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(4, 32, 16, dtype=torch.bfloat16)
    offsets_G = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    assert _kernel_shape(aten._grouped_mm.default, (rows_RK, weights_GKN, offsets_G), {}) == (16, 16, 32)
    # Along K (the experts' weight gradient): x (M, K summed over groups), y (K, N) -> per group (M, N, K / groups).
    x_MK, y_KN = torch.empty(32, 64, dtype=torch.bfloat16), torch.empty(64, 16, dtype=torch.bfloat16)
    assert _kernel_shape(aten._grouped_mm.default, (x_MK, y_KN, offsets_G), {}) == (32, 16, 16)
    assert _kernel_shape(aten.add.Tensor, (a_MK, a_MK), {}) == ()


def test_the_plan_prints_attentions_time_at_both_ends_and_the_step_it_would_make():
    from npu_inject.planner import render

    timing = SimpleNamespace(step_s=10.0, by_class={("attention", "forward"): 1.0, ("attention", "backward"): 3.0,
                                                     ("matmul", "forward"): 2.0}, compute_s=6.0, overhead_s=1.5)
    plan = SimpleNamespace(info={"attention_rate_range": {"slow": 1.5, "fast": 0.75}}, timing=timing)
    assert render.attention_range(plan) == (4.0, 3.0, 6.0)
    assert render.attention_range_lines(plan) == [
        "  attention 4.000 s at the profile's rates, 3.000 to 6.000 s across the ranges of their sources (published "
        "points and estimates' bounds; the step 8.750 to 12.500 s if attention's time moves it one for one)"]
    # the step moves by attention's change and the overhead's share of it (0.25 of the compute): -1.25 and +2.5 s
    plan.info["attention_rate_range"] = None  # measured rates
    assert render.attention_range(plan) is None and render.attention_range_lines(plan) == []
