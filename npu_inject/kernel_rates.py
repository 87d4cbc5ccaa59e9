"""Measured kernel rates: what a profile's kernels reach, by operator class and shape.

``npu-inject calibrate`` measures them on the machine it runs on and writes them into a hardware file
(a profile's ``rates``); the planner's cost model reads them instead of one fitted fraction per family.
Each class is a table of measured points, looked up by shape:

* ``matmul``: TFLOP/s of ``C[M, N] = A[M, K] @ B[K, N]`` per dtype on a rectilinear grid of M, N and K;
  a shape between grid points is interpolated (trilinearly, in log2 of each dimension), one beyond
  the grid takes the nearest edge.
* ``attention``: TFLOP/s of the fused attention by kernel and direction (forward, backward) over the
  sequence length and head dimension (causal and full masks apart), interpolated in log2 of the length. A
  point taken from others' measurements may carry ``range`` ``[low, high]``: what its sources span (or an
  estimate's stated bounds); the plan prints attention's time at both ends (:meth:`Rates.at_attention_end`).
* ``memory``: GB/s (bytes read plus written) of elementwise kernels by the bytes they move, per dtype.
* ``fused``: GB/s of the fused elementwise kernels the patches call (``npu_rms_norm``, ``npu_rotary_mul``,
  ``npu_swiglu``), forward and backward, by the bytes they move.
* ``kernel_us`` (the shortest device time of a launch) and ``host_us`` (the host's time to issue
  one eager operator).
* ``collectives``: bus bandwidth and latency of each collective by message size (measured where
  several devices are visible).

Every point carries its ``source`` ("measured <date> on <device> with <versions>", or a citation).
Stdlib only: the planner's parent process and ``npu-inject check`` read it without torch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Any

from npu_inject.errors import ConfigError

CLASSES = ("matmul", "attention", "memory", "collectives")
DIRECTIONS = ("forward", "backward")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def positive(where: str, value: Any) -> float:
    """``value`` as a float when it is a finite number above 0, else ConfigError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where} must be a finite number above 0, got {value!r}")
    return float(value)


def _source(where: str, point: dict) -> str:
    source = point.get("source")
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{where}.source must say where the number comes from (e.g. 'measured <date> on <device>')")
    return source


def _lerp_log(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear in log2(x) through (xs, ys), xs ascending; clamped beyond the ends."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    t = (math.log2(x) - math.log2(xs[i])) / (math.log2(xs[i + 1]) - math.log2(xs[i]))
    return ys[i] + t * (ys[i + 1] - ys[i])


@dataclass
class MatmulGrid:
    """TFLOP/s of one dtype on the grid ms x ns x ks (every combination measured)."""

    ms: list[float]
    ns: list[float]
    ks: list[float]
    tflops: dict[tuple[float, float, float], float]

    def at(self, m: float, n: float, k: float) -> float:
        def along(axis: list[float], x: float) -> list[tuple[float, float]]:
            """The one or two grid values around ``x`` with their weights (log2 spacing)."""
            if len(axis) == 1 or x <= axis[0]:
                return [(axis[0], 1.0)]
            if x >= axis[-1]:
                return [(axis[-1], 1.0)]
            i = bisect.bisect_right(axis, x) - 1
            t = (math.log2(x) - math.log2(axis[i])) / (math.log2(axis[i + 1]) - math.log2(axis[i]))
            return [(axis[i], 1.0 - t), (axis[i + 1], t)]

        return sum(wm * wn * wk * self.tflops[(gm, gn, gk)]
                   for gm, wm in along(self.ms, m) for gn, wn in along(self.ns, n) for gk, wk in along(self.ks, k))


@dataclass
class AttentionCurve:
    """TFLOP/s of one kernel, direction, mask and head dimension over the sequence length; ``low`` and ``high``
    the ends of each point's range (the point itself where it has none)."""

    seqs: list[float]
    tflops: list[float]
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.low = self.low or list(self.tflops)
        self.high = self.high or list(self.tflops)

    def at(self, seq: float) -> float:
        return _lerp_log(self.seqs, self.tflops, seq)

    @property
    def ranged(self) -> bool:
        return self.low != self.tflops or self.high != self.tflops


@dataclass
class Rates:
    """A profile's measured rates (see the module docstring); ``about`` says where, when and how."""

    about: str
    partial: bool
    matmul: dict[str, MatmulGrid] = field(default_factory=dict)  # dtype -> grid
    grouped: dict[str, MatmulGrid] = field(default_factory=dict)  # dtype -> grid of per-group M, N, K
    attention: dict[tuple[str, str, bool, int], AttentionCurve] = field(default_factory=dict)  # kernel, dir, causal, d
    attention_kernel: str = ""  # the kernel the planned job runs
    memory: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # dtype -> (bytes, GB/s)
    kernel_us: float | None = None
    host_us: float | None = None
    fused: dict[tuple[str, str], tuple[list[float], list[float]]] = field(default_factory=dict)  # (kernel, dir) -> curve
    collectives: dict[str, tuple[list[float], list[float], float]] = field(default_factory=dict)  # bytes, GB/s, us
    missing: list[str] = field(default_factory=list)  # classes a partial file lacks

    # -- lookups -------------------------------------------------------------------------------
    def matmul_tflops(self, dtype: str, m: float, n: float, k: float) -> float | None:
        grid = self.matmul.get(dtype) or self.matmul.get("bf16")
        return grid.at(m, n, k) if grid is not None else None

    def grouped_tflops(self, dtype: str, m: float, n: float, k: float) -> float | None:
        """A grouped matmul of groups ``m`` rows each; the dense grid where no grouped one was measured."""
        grid = self.grouped.get(dtype) or self.grouped.get("bf16")
        return grid.at(m, n, k) if grid is not None else self.matmul_tflops(dtype, m, n, k)

    def attention_tflops(self, direction: str, seq: float, head_dim: float, causal: bool) -> float | None:
        candidates = [(abs(math.log2(d / head_dim)), curve) for (kernel, way, masked, d), curve in self.attention.items()
                      if kernel == self.attention_kernel and way == direction and masked == causal]
        if not candidates:
            candidates = [(abs(math.log2(d / head_dim)), curve) for (kernel, way, _masked, d), curve
                          in self.attention.items() if kernel == self.attention_kernel and way == direction]
        if not candidates:
            return None
        return min(candidates, key=lambda pair: pair[0])[1].at(seq)

    @property
    def attention_ranged(self) -> bool:
        """Whether any of the planned kernel's attention points carries a range."""
        return any(curve.ranged for key, curve in self.attention.items() if key[0] == self.attention_kernel)

    def at_attention_end(self, end: str) -> "Rates":
        """These rates with every attention point at the ``low`` or ``high`` end of its range."""
        if end not in ("low", "high"):
            raise ValueError(f"end must be 'low' or 'high', got {end!r}")
        curves = {key: AttentionCurve(curve.seqs, list(getattr(curve, end))) for key, curve in self.attention.items()}
        return replace(self, attention=curves)

    def memory_gbps_at(self, nbytes: float, dtype: str = "") -> float | None:
        """GB/s of an elementwise kernel moving ``nbytes`` in ``dtype`` (the first measured dtype's curve for
        another dtype)."""
        curve = self.memory.get(dtype) or next(iter(self.memory.values()), None)
        return _lerp_log(*curve, max(nbytes, 1.0)) if curve else None

    def fused_gbps(self, kernel: str, direction: str, nbytes: float) -> float | None:
        curve = self.fused.get((kernel, direction))
        return _lerp_log(*curve, max(nbytes, 1.0)) if curve else None

    def collective(self, kind: str, nbytes: float) -> tuple[float, float] | None:
        """(bus GB/s at this size, latency us) of ``kind``, or None when not measured."""
        table = self.collectives.get(kind)
        if table is None:
            return None
        sizes, gbps, latency_us = table
        return _lerp_log(sizes, gbps, max(nbytes, 1.0)), latency_us


def parse(where: str, raw: Any) -> Rates:
    """A profile's ``rates`` object, validated: every number positive and finite, every point sourced."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object (see docs/planner.md, 'Measured rates')")
    known = {"about", "partial", "missing", "attention_kernel", "matmul", "attention", "memory", "fused", "kernel_us",
             "host_us", "collectives"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (a rates object has {', '.join(sorted(known))})")
    about = raw.get("about")
    if not isinstance(about, str) or not about:
        raise ConfigError(f"{where}.about must say where and how the rates were measured")
    rates = Rates(about, bool(raw.get("partial", False)), missing=list(raw.get("missing", [])))
    _parse_matmul(f"{where}.matmul", raw.get("matmul", []), rates)
    _parse_attention(f"{where}.attention", raw.get("attention", []), rates)
    rates.attention_kernel = raw.get("attention_kernel", "")
    if rates.attention and rates.attention_kernel not in {key[0] for key in rates.attention}:
        kernels = sorted({key[0] for key in rates.attention})
        raise ConfigError(f"{where}.attention_kernel {rates.attention_kernel!r} is not a measured kernel "
                          f"(measured: {', '.join(kernels)})")
    curves: dict[str, dict[float, float]] = {}
    for i, point in enumerate(_points(f"{where}.memory", raw.get("memory", []))):
        at = f"{where}.memory[{i}]"
        _source(at, point)
        curves.setdefault(str(point.get("dtype", "fp32")), {})[positive(f"{at}.bytes", point.get("bytes"))] = \
            positive(f"{at}.gbps", point.get("gbps"))
    rates.memory = {dtype: (sorted(curve), [curve[size] for size in sorted(curve)]) for dtype, curve in curves.items()}
    fused: dict[tuple[str, str], dict[float, float]] = {}
    for i, point in enumerate(_points(f"{where}.fused", raw.get("fused", []))):
        at = f"{where}.fused[{i}]"
        _source(at, point)
        kernel, direction = point.get("kernel"), point.get("direction")
        if not isinstance(kernel, str) or direction not in DIRECTIONS:
            raise ConfigError(f"{at} must name its kernel and a direction ({', '.join(DIRECTIONS)})")
        fused.setdefault((kernel, direction), {})[positive(f"{at}.bytes", point.get("bytes"))] = \
            positive(f"{at}.gbps", point.get("gbps"))
    rates.fused = {key: (sorted(curve), [curve[size] for size in sorted(curve)]) for key, curve in fused.items()}
    for key in ("kernel_us", "host_us"):
        if key in raw:
            entry = raw[key]
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}.{key} must be {{\"value\": <us>, \"source\": \"...\"}}")
            _source(f"{where}.{key}", entry)
            setattr(rates, key, positive(f"{where}.{key}.value", entry.get("value")))
    for i, point in enumerate(_points(f"{where}.collectives", raw.get("collectives", []))):
        at = f"{where}.collectives[{i}]"
        kind = point.get("op")
        if kind not in COLLECTIVES:
            raise ConfigError(f"{at}.op must be one of {', '.join(COLLECTIVES)}, got {kind!r}")
        _source(at, point)
        sizes, gbps, latency = rates.collectives.setdefault(kind, ([], [], 0.0))
        sizes.append(positive(f"{at}.bytes", point.get("bytes")))
        gbps.append(positive(f"{at}.bus_gbps", point.get("bus_gbps")))
        rates.collectives[kind] = (sizes, gbps, positive(f"{at}.latency_us", point.get("latency_us")))
    for kind, (sizes, gbps, latency) in rates.collectives.items():
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        rates.collectives[kind] = ([sizes[i] for i in order], [gbps[i] for i in order], latency)
    return rates


def _points(where: str, raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not all(isinstance(point, dict) for point in raw):
        raise ConfigError(f"{where} must be a list of objects (measured points)")
    return raw


def _parse_matmul(where: str, raw: Any, rates: Rates) -> None:
    """Dense points by dtype into ``rates.matmul``, grouped ones (with ``groups``) into ``rates.grouped``."""
    by_dtype: dict[tuple[bool, str], dict[tuple[float, float, float], float]] = {}
    for i, point in enumerate(_points(where, raw)):
        at = f"{where}[{i}]"
        _source(at, point)
        dtype = point.get("dtype")
        if not isinstance(dtype, str):
            raise ConfigError(f"{at}.dtype must name a dtype (bf16, fp16, fp32)")
        shape = tuple(positive(f"{at}.{axis}", point.get(axis)) for axis in ("m", "n", "k"))
        grouped = "groups" in point and positive(f"{at}.groups", point["groups"]) > 0
        by_dtype.setdefault((grouped, dtype), {})[shape] = positive(f"{at}.tflops", point.get("tflops"))
    for (grouped, dtype), table in by_dtype.items():
        ms, ns, ks = (sorted({shape[axis] for shape in table}) for axis in range(3))
        absent = [(m, n, k) for m in ms for n in ns for k in ks if (m, n, k) not in table]
        if absent:
            raise ConfigError(f"{where}: the {'grouped ' if grouped else ''}{dtype} points are not a full grid of "
                              f"m x n x k ({len(absent)} missing, e.g. m={absent[0][0]:g} n={absent[0][1]:g} "
                              f"k={absent[0][2]:g})")
        (rates.grouped if grouped else rates.matmul)[dtype] = MatmulGrid(ms, ns, ks, table)


def _parse_attention(where: str, raw: Any, rates: Rates) -> None:
    curves: dict[tuple[str, str, bool, int], list[tuple[float, float, float, float]]] = {}
    for i, point in enumerate(_points(where, raw)):
        at = f"{where}[{i}]"
        _source(at, point)
        kernel, direction = point.get("kernel"), point.get("direction")
        if not isinstance(kernel, str) or not kernel:
            raise ConfigError(f"{at}.kernel must name the kernel measured")
        if direction not in DIRECTIONS:
            raise ConfigError(f"{at}.direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        if not isinstance(point.get("causal"), bool):
            raise ConfigError(f"{at}.causal must be true or false")
        key = (kernel, direction, point["causal"], int(positive(f"{at}.head_dim", point.get("head_dim"))))
        tflops = positive(f"{at}.tflops", point.get("tflops"))
        low = high = tflops
        if "range" in point:
            bounds = point["range"]
            if not isinstance(bounds, list) or len(bounds) != 2:
                raise ConfigError(f"{at}.range must be [low, high] in TFLOP/s, got {bounds!r}")
            low, high = (positive(f"{at}.range[{end}]", value) for end, value in enumerate(bounds))
            if not low <= tflops <= high:
                raise ConfigError(f"{at}.range [{low:g}, {high:g}] must hold its tflops {tflops:g} (low <= tflops <= high)")
        curves.setdefault(key, []).append((positive(f"{at}.seq", point.get("seq")), tflops, low, high))
    for key, points in curves.items():
        by_seq: dict[float, list[tuple[float, float, float]]] = {}
        for seq, *values in points:
            by_seq.setdefault(seq, []).append(tuple(values))  # shapes of one length (batch, heads): their mean
        seqs = sorted(by_seq)
        means = [[sum(column) / len(column) for column in zip(*by_seq[seq])] for seq in seqs]
        tflops, low, high = (list(column) for column in zip(*means))
        rates.attention[key] = AttentionCurve(seqs, tflops, low, high)
