"""The kernels ``npu-inject calibrate`` times, on whichever device this machine has.

One :class:`Device` per backend: an Ascend NPU through torch_npu (its own kernels: ``npu_fusion_attention``,
``npu_grouped_matmul``), a CUDA GPU through torch (SDPA's attention backends, ``torch._grouped_mm``), or
the CPU (the rehearsal's reference kernels, which are what a rehearsal runs). Each suite returns the
points of one class of :mod:`npu_inject.kernel_rates` (without their ``source``, which the command adds).

FLOPs are counted as the planner counts them (:mod:`npu_inject.planner.trace`): a matmul 2*M*N*K; the
fused attention 2 * pairs * heads * (qk_dim + v_dim), halved for a causal mask, its backward 2.5 times
the forward. Times are device times (events on a GPU or NPU), the mean over repetitions after warm-up.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from npu_inject.cpu_features import cpu_model

GiB = 1 << 30


class DeviceUnavailable(Exception):
    """No device of the asked kind, or it cannot run (busy, out of memory, no driver): one line."""


@dataclass
class Device:
    kind: str  # "npu", "cuda", "cpu"
    name: str  # what the backend calls it ("Ascend910B2", "NVIDIA H100 80GB HBM3", "cpu: <model>")
    versions: str  # torch, torch_npu / CUDA, CANN where known
    torch_device: torch.device
    count: int  # devices of this kind visible
    threads: int = 0  # CPU: torch's intra-op threads while measuring
    quick: bool = False  # a few small shapes: checks that every suite runs (seconds), not rates to plan with

    def sync(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()
        elif self.kind == "npu":
            torch.npu.synchronize()

    def seconds(self, run: Callable[[], object], *, repeat: int) -> float:
        """Device time of ``repeat`` calls of ``run`` (events on an accelerator, the clock on the CPU).

        On an accelerator a queue of long matmuls goes first, so that the host issues the calls while the
        device is still busy: a short kernel is timed back to back, not at the rate the host issues it."""
        if self.kind == "cpu":
            started = time.perf_counter()
            for _ in range(repeat):
                run()
            return time.perf_counter() - started
        events = torch.cuda if self.kind == "cuda" else torch.npu
        begin, end = events.Event(enable_timing=True), events.Event(enable_timing=True)
        self._fill_queue(repeat)
        begin.record()
        for _ in range(repeat):
            run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


    _filler: tuple | None = None  # (a, seconds of one a @ a): the queue's filler

    def _fill_queue(self, calls: int, host_us_per_call: float = 40.0) -> None:
        """Enough device work queued to outlast the host's issuing of ``calls`` calls."""
        if self._filler is None:
            a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=self.torch_device)
            for _ in range(3):
                a @ a
            self.sync()
            events = torch.cuda if self.kind == "cuda" else torch.npu
            begin, end = events.Event(enable_timing=True), events.Event(enable_timing=True)
            begin.record()
            for _ in range(10):
                a @ a
            end.record()
            end.synchronize()
            self._filler = (a, begin.elapsed_time(end) / 1e3 / 10)
        a, seconds = self._filler
        for _ in range(min(int(calls * host_us_per_call * 1e-6 / seconds) + 1, 2000)):
            a @ a


def open_device(kind: str | None) -> Device:
    """The device to calibrate: ``kind`` ("npu", "cuda", "cpu") or the first of them this machine has."""
    versions = f"torch {torch.__version__}"
    if kind in (None, "npu"):
        try:
            import torch_npu  # noqa: F401 (registers torch.npu)
        except ImportError as exc:
            if kind == "npu":
                raise DeviceUnavailable(f"--device npu: torch_npu does not import ({exc})") from None
        else:
            if torch.npu.is_available() and torch.npu.device_count() > 0:
                return _ready(Device("npu", torch.npu.get_device_name(0), f"{versions}, torch_npu {torch_npu.__version__}",
                                     torch.device("npu", 0), torch.npu.device_count()))
            if kind == "npu":
                raise DeviceUnavailable("--device npu: torch_npu imports but sees no NPU (torch.npu.device_count() is 0)")
    if kind in (None, "cuda"):
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return _ready(Device("cuda", torch.cuda.get_device_name(0), f"{versions}, CUDA {torch.version.cuda}",
                                 torch.device("cuda", 0), torch.cuda.device_count()))
        if kind == "cuda":
            raise DeviceUnavailable("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    return Device("cpu", f"cpu: {cpu_model()}", versions, torch.device("cpu"), 1, torch.get_num_threads())


def _ready(device: Device) -> Device:
    """``device`` once a first allocation and kernel ran on it (a busy or broken device fails here, in one line)."""
    try:
        probe = torch.ones(1024, device=device.torch_device)
        (probe + probe).sum().item()
    except RuntimeError as exc:
        raise DeviceUnavailable(f"{device.kind}:0 ({device.name}) cannot run a first kernel: "
                                f"{str(exc).splitlines()[0]}") from None
    return device


def significant(rate: float, digits: int = 4) -> float:
    """``rate`` to ``digits`` significant figures: a fixed number of decimals wrote a slow kernel's measured rate
    (a loaded CPU's attention, 3e-5 TFLOP/s) as 0.0, which the profile then refuses."""
    return float(f"{rate:.{digits}g}")


def mean_seconds(device: Device, run: Callable[[], object], *, budget_s: float, warmup: int = 2) -> float:
    """Mean device seconds of one call of ``run``: warm-up calls, one timed call to size the repetitions,
    then as many more as fit ``budget_s`` (none when the timed call took the budget; at most 200)."""
    for _ in range(warmup):
        run()
    device.sync()
    once = device.seconds(run, repeat=1)
    repeat = min(200, int(budget_s / max(once, 1e-6)))
    if repeat <= 1:
        return once
    return device.seconds(run, repeat=repeat) / repeat


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def matmul_grid(device: Device) -> tuple[list[int], list[int], list[int]]:
    """M (tokens), N and K of the grid: small and skinny shapes through a large model's."""
    if device.quick:
        return [16, 64], [16, 64], [16, 64]
    if device.kind == "cpu":
        return [64, 512, 4096], [64, 256, 1024, 2048], [64, 256, 1024, 2048]
    return [128, 1024, 4096, 16384], [128, 1024, 4096, 16384], [128, 1024, 4096, 16384]


def matmul(device: Device, dtype: str, progress: Callable[[str], None], *, budget_s: float) -> list[dict]:
    ms, ns, ks = matmul_grid(device)
    points = []
    torch_dtype = DTYPES[dtype]
    shapes = [(m, n, k) for m in ms for n in ns for k in ks]
    per_shape = budget_s / len(shapes)
    for index, (m, n, k) in enumerate(shapes):
        a_MK = torch.randn(m, k, dtype=torch_dtype, device=device.torch_device)
        b_KN = torch.randn(k, n, dtype=torch_dtype, device=device.torch_device)
        seconds = mean_seconds(device, lambda: torch.mm(a_MK, b_KN), budget_s=per_shape, warmup=1)
        tflops = 2.0 * m * n * k / seconds / 1e12
        points.append({"dtype": dtype, "m": m, "n": n, "k": k, "tflops": significant(tflops)})
        progress(f"matmul {dtype} {index + 1}/{len(shapes)}: M {m} N {n} K {k}: {tflops:.3g} TFLOP/s")
        del a_MK, b_KN
    return points


# An MoE layer's grouped product takes its local tokens x top-k rows at once (qwen3_30b_a3b: 2 x 4096 tokens x 8
# = 65,536 rows over 128 experts). Eight groups of 128 rows fill a fraction of an accelerator and planned
# qwen3_30b_a3b's grouped products 1.5x slower than measured on an H200 (docs/planner.md), so on an accelerator
# a point takes as many groups as give GROUPED_ROWS rows, at most GROUPED_MAX_GROUPS (experts per rank
# in the configs torchtitan ships) and GROUPED_WEIGHT_BYTES of weights, at least 8.
GROUPED_ROWS = 65536
GROUPED_MAX_GROUPS = 128
GROUPED_WEIGHT_BYTES = 4 << 30


def grouped_count(device: Device, m: int, n: int, k: int, itemsize: int) -> int:
    """The number of groups of ``m`` rows a grouped point is measured with (8 on a CPU, which has no device to fill)."""
    if device.kind == "cpu" or device.quick:
        return 8
    return max(8, min(GROUPED_ROWS // m, GROUPED_MAX_GROUPS, GROUPED_WEIGHT_BYTES // (n * k * itemsize)))


def grouped_matmul(device: Device, dtype: str, progress: Callable[[str], None], *, budget_s: float) -> list[dict]:
    """M-grouped products of equal rows on a coarse :func:`matmul_grid` (three per-group M, the corners of N and K),
    :func:`grouped_count` groups each: y[rows of g] = x[rows of g] @ w[g]."""
    ms, ns, ks = matmul_grid(device)
    # Three per-group M (an expert's rows vary most between jobs), two N and K.
    shapes = [(m, n, k) for m in sorted({ms[0], ms[1], ms[-2]}) for n in (ns[1], ns[-1]) for k in (ks[1], ks[-1])]
    points = []
    per_shape = budget_s / len(shapes)
    torch_dtype = DTYPES[dtype]
    for index, (m, n, k) in enumerate(shapes):
        groups = grouped_count(device, m, n, k, torch.finfo(torch_dtype).bits // 8)
        x_RK = torch.randn(groups * m, k, dtype=torch_dtype, device=device.torch_device)
        w_GKN = torch.randn(groups, k, n, dtype=torch_dtype, device=device.torch_device)
        ends_G = torch.arange(m, groups * m + 1, m, dtype=torch.int64, device=device.torch_device)
        run = _grouped_kernel(device, x_RK, w_GKN, ends_G)
        seconds = mean_seconds(device, run, budget_s=per_shape, warmup=1)
        tflops = 2.0 * groups * m * n * k / seconds / 1e12
        points.append({"dtype": dtype, "m": m, "n": n, "k": k, "groups": groups, "tflops": significant(tflops)})
        progress(f"grouped matmul {dtype} {index + 1}/{len(shapes)}: {groups} x M {m} N {n} K {k}: {tflops:.3g} TFLOP/s")
    return points


def _grouped_kernel(device: Device, x_RK, w_GKN, ends_G) -> Callable[[], object]:
    """A call of this device's grouped matmul on these operands, prepared as its kernel takes them."""
    if device.kind == "npu":
        import torch_npu

        return lambda: torch_npu.npu_grouped_matmul([x_RK], [w_GKN], group_list=ends_G, group_list_type=0,
                                                    group_type=0, split_item=3)
    if device.kind == "cuda":
        # torch's grouped GEMM takes int32 offsets and each weight's K dimension contiguous (torchtitan
        # passes its (E, N, K) weights transposed).
        w_GKN = w_GKN.transpose(-2, -1).contiguous().transpose(-2, -1)
        ends_G = ends_G.to(torch.int32)
        return lambda: torch._grouped_mm(x_RK, w_GKN, offs=ends_G)
    from npu_inject.ops import reference

    return lambda: reference.npu_grouped_matmul([x_RK], [w_GKN], group_list=ends_G, group_list_type=0,
                                                group_type=0, split_item=3)


def attention_kernels(device: Device) -> dict[str, Callable]:
    """name -> run(q_BSND, k_BSND, v_BSND, causal) for each fused attention this device offers."""
    if device.kind == "npu":
        import torch_npu

        mask = torch.ones(2048, 2048, dtype=torch.bool, device=device.torch_device).triu(1)

        def npu_fusion_attention(q, k, v, causal):
            # sparse_mode 2: left-up causal over the compressed 2048 x 2048 mask (as the attention patch calls it)
            return torch_npu.npu_fusion_attention(q, k, v, q.shape[2], "BSND", atten_mask=mask if causal else None,
                                                  scale=q.shape[-1] ** -0.5, sparse_mode=2 if causal else 0)[0]

        return {"npu_fusion_attention": npu_fusion_attention}
    if device.kind == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(backend):
            def run(q, k, v, causal):
                q_BNSD, k_BNSD, v_BNSD = (t.transpose(1, 2) for t in (q, k, v))
                gqa = k_BNSD.shape[1] != q_BNSD.shape[1]
                if backend is None:
                    return torch.nn.functional.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, is_causal=causal,
                                                                            enable_gqa=gqa).transpose(1, 2)
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, is_causal=causal,
                                                                            enable_gqa=gqa).transpose(1, 2)
            return run

        return {"sdpa": sdpa(None), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
                "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    from npu_inject.ops import reference

    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)

    def rehearsal(q, k, v, causal):
        return reference.npu_fusion_attention(q, k, v, q.shape[2], "BSND", atten_mask=mask if causal else None,
                                              scale=q.shape[-1] ** -0.5, sparse_mode=2 if causal else 0)[0]

    return {"reference_fusion_attention": rehearsal}


def attention_shapes(device: Device) -> list[tuple[int, int, int, int, int]]:
    """(batch, seq, heads, kv_heads, head_dim): a fixed token count over sequence lengths, GQA 4:1."""
    if device.quick:
        return [(1, 64, 4, 2, 16)]
    if device.kind == "cpu":
        return [(max(1024 // seq, 1), seq, 16, 4, d) for seq in (128, 256, 512, 1024, 2048) for d in (16, 64)]
    return [(16384 // seq, seq, 32, 8, d) for seq in (1024, 4096, 16384) for d in (64, 128)]


def attention(device: Device, dtype: str, progress: Callable[[str], None], *, budget_s: float) -> list[dict]:
    kernels = attention_kernels(device)
    shapes = attention_shapes(device)
    cases = [(name, shape, causal) for name in kernels for shape in shapes for causal in (True, False)]
    per_case = budget_s / max(len(cases), 1)
    points = []
    torch_dtype = DTYPES[dtype]
    for index, (name, (batch, seq, heads, kv_heads, d), causal) in enumerate(cases):
        run = kernels[name]
        q = torch.randn(batch, seq, heads, d, dtype=torch_dtype, device=device.torch_device, requires_grad=True)
        k = torch.randn(batch, seq, kv_heads, d, dtype=torch_dtype, device=device.torch_device, requires_grad=True)
        v = torch.randn(batch, seq, kv_heads, d, dtype=torch_dtype, device=device.torch_device, requires_grad=True)
        flops = 2.0 * batch * seq * seq * heads * (d + d) * (0.5 if causal else 1.0)
        try:
            try:
                out = run(q, k, v, causal)
            except RuntimeError:
                if kv_heads == heads:
                    raise
                # A kernel without grouped-query support: the key/value heads repeated once, outside the timing.
                k, v = (t.detach().repeat_interleave(heads // kv_heads, dim=2).requires_grad_() for t in (k, v))
                out = run(q, k, v, causal)
            grad = torch.randn_like(out)

            def forward_backward():
                torch.autograd.grad(run(q, k, v, causal), (q, k, v), grad)

            forward = mean_seconds(device, lambda: run(q, k, v, causal), budget_s=per_case / 3, warmup=1)
            both = mean_seconds(device, forward_backward, budget_s=2 * per_case / 3, warmup=1)
        except RuntimeError as exc:  # a kernel that does not take this shape or dtype (its message says why)
            progress(f"attention {name} seq {seq} d {d}{' causal' if causal else ''}: not run: "
                     f"{str(exc).splitlines()[0][:160]}")
            continue
        if both <= forward:  # a backward timed at nothing would be written as an absurd rate the planner takes
            progress(f"attention {name} seq {seq} d {d}{' causal' if causal else ''}: not recorded: forward and "
                     f"backward took {both * 1e3:.3g} ms, no longer than the forward alone ({forward * 1e3:.3g} ms): "
                     "the host was busy")
            continue
        backward = both - forward
        common = {"kernel": name, "dtype": dtype, "batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads,
                  "head_dim": d, "causal": causal, "layout": "BSND"}
        points.append({**common, "direction": "forward", "tflops": significant(flops / forward / 1e12)})
        points.append({**common, "direction": "backward", "tflops": significant(2.5 * flops / backward / 1e12)})
        progress(f"attention {index + 1}/{len(cases)} {name} seq {seq} d {d}{' causal' if causal else ''}: "
                 f"forward {flops / forward / 1e12:.3g}, backward {2.5 * flops / backward / 1e12:.3g} TFLOP/s")
    return points


def memory(device: Device, dtype: str, progress: Callable[[str], None], *, budget_s: float) -> list[dict]:
    """GB/s (bytes read plus written) of an elementwise add into a new tensor, as a training step's operators
    make theirs, from 64 KiB to 1 GiB (256 MiB on the CPU) per operand, in ``dtype``."""
    top = 18 if device.quick else 28 if device.kind == "cpu" else 30
    sizes = [1 << exponent for exponent in range(16, top + 1, 2)]
    points = []
    per_case = budget_s / len(sizes)
    torch_dtype = DTYPES[dtype]
    for size in sizes:
        elements = size // torch.empty((), dtype=torch_dtype).element_size()
        a = torch.ones(elements, dtype=torch_dtype, device=device.torch_device)
        b = torch.full_like(a, 2.0)
        seconds = mean_seconds(device, lambda: torch.add(a, b), budget_s=per_case)
        points.append({"op": "add", "dtype": dtype, "bytes": 3 * size, "gbps": significant(3 * size / seconds / 1e9)})
        progress(f"memory {dtype} {size >> 10} KiB per operand: add {points[-1]['gbps']:.4g} GB/s")
        del a, b
    return points


FUSED = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu")


def fused(device: Device, dtype: str, progress: Callable[[str], None], *, budget_s: float) -> list[dict]:
    """GB/s of the fused elementwise kernels the patches call (torch_npu's on an NPU, the rehearsal's reference
    kernels on the CPU), forward and backward, by the bytes the kernel reads and writes (as the planner counts
    them: its tensor arguments and results). A GPU runs none of them (torchtitan's own operators stand there)."""
    if device.kind == "cuda":
        return []
    if device.kind == "npu":
        import torch_npu as kernels
    else:
        from npu_inject.ops import reference as kernels
    torch_dtype = DTYPES[dtype]
    sizes = ([1 << 16] if device.quick else [1 << exponent for exponent in (16, 20, 24)] if device.kind == "cpu"
             else [1 << e for e in (18, 22, 26, 28)])
    cases = [(name, size) for name in FUSED for size in sizes]
    per_case = budget_s / len(cases)
    points = []
    on = device.torch_device
    for name, size in cases:
        elements = size // torch.empty((), dtype=torch_dtype).element_size()
        dim = 256 if elements >= 256 * 64 else 64
        rows = max(elements // dim, 1)
        if name == "npu_rms_norm":
            x = torch.randn(rows, dim, dtype=torch_dtype, device=on, requires_grad=True)
            gamma = torch.ones(dim, dtype=torch_dtype, device=on, requires_grad=True)
            inputs, run = (x, gamma), lambda: kernels.npu_rms_norm(x, gamma)[0]
        elif name == "npu_rotary_mul":
            x = torch.randn(1, rows, 1, dim, dtype=torch_dtype, device=on, requires_grad=True)
            r1, r2 = (torch.randn(1, rows, 1, dim, dtype=torch_dtype, device=on) for _ in range(2))
            inputs, run = (x, r1, r2), lambda: kernels.npu_rotary_mul(x, r1, r2)
        else:
            x = torch.randn(rows, 2 * dim, dtype=torch_dtype, device=on, requires_grad=True)
            inputs, run = (x,), lambda: kernels.npu_swiglu(x, -1)
        out = run()
        grad = torch.ones_like(out)
        forward = mean_seconds(device, run, budget_s=per_case / 3, warmup=1)
        both = mean_seconds(device, lambda: torch.autograd.grad(run(), x, grad), budget_s=2 * per_case / 3, warmup=1)
        moved_forward = sum(t.numel() * t.element_size() for t in (*inputs, out))
        moved_backward = moved_forward + grad.numel() * grad.element_size()
        if both <= forward:  # a backward timed at nothing would be written as an absurd rate the planner takes
            progress(f"fused {name} {size >> 10} KiB: not recorded: forward and backward took {both * 1e3:.3g} ms, "
                     f"no longer than the forward alone ({forward * 1e3:.3g} ms): the host was busy")
            continue
        backward = both - forward
        points.append({"kernel": name, "direction": "forward", "dtype": dtype, "bytes": moved_forward,
                       "gbps": significant(moved_forward / forward / 1e9)})
        points.append({"kernel": name, "direction": "backward", "dtype": dtype, "bytes": moved_backward,
                       "gbps": significant(moved_backward / backward / 1e9)})
        progress(f"fused {name} {size >> 10} KiB: forward {points[-2]['gbps']:.4g}, backward {points[-1]['gbps']:.4g} GB/s")
    return points


def load_cpu(others: int, seconds: float) -> list:
    """``others`` processes that keep one core each busy with a rehearsal rank's kind of work (bf16 matmuls and
    elementwise kernels) for ``seconds``: the CPU shared as the rehearsal's ranks share it."""
    import subprocess
    import sys

    code = ("import time, torch; torch.set_num_threads(1); a = torch.randn(512, 512, dtype=torch.bfloat16); "
            f"end = time.time() + {seconds}\nwhile time.time() < end: (a @ a).exp_().mul_(0.5)")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(others)]


class _Counter:
    """Counts the ATen operators a call dispatches (below autograd: forward and backward alike)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.operators += 1
                return func(*args, **(kwargs or {}))

        self.operators = 0
        self.mode = Mode


def launch_and_host(device: Device, progress: Callable[[str], None]) -> tuple[float, float]:
    """(kernel_us, host_us): the device time of a tiny kernel back to back, and the host's time per operator of
    a training step: a tiny decoder block's forward and backward (module calls, autograd, dispatch, launch)
    divided by the operators it dispatches. On an accelerator a queue of long matmuls goes first, so the tiny
    kernels' device time is measured without the host in the way; on the CPU the thread that issues a kernel
    runs it, and a tiny kernel's time is the host's."""
    on = device.torch_device
    # Sixteen tiny blocks: one backward call per step, as a model's, its fixed cost spread over many operators.
    blocks = torch.nn.ModuleList(torch.nn.Sequential(
        torch.nn.RMSNorm(16), torch.nn.Linear(16, 32, bias=False), torch.nn.SiLU(), torch.nn.Linear(32, 16, bias=False))
        for _ in range(16)).to(on)
    x = torch.ones(4, 16, device=on, requires_grad=True)

    def step():
        h = x
        for block in blocks:
            h = h + block(h)
        h.sum().backward()

    counter = _Counter()
    with counter.mode():
        step()
    steps = 5 if device.quick else 30
    for _ in range(2 if device.quick else 5):
        step()
    device.sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    host_us = (time.perf_counter() - started) / (steps * counter.operators) * 1e6
    device.sync()
    tiny, out = torch.ones(16, device=on), torch.empty(16, device=on)
    calls = 50 if device.quick else 500
    kernel_us = device.seconds(lambda: torch.add(tiny, tiny, out=out), repeat=calls) * 1e6 / calls
    progress(f"launch: {kernel_us:.3g} us per tiny kernel on the device; {host_us:.3g} us of the host's time per "
             f"operator of a training step ({counter.operators} operators per step of sixteen tiny blocks)")
    return kernel_us, host_us


def peak_summary(points: list[dict]) -> float:
    """The best TFLOP/s among ``points`` (for the progress line)."""
    return max((point["tflops"] for point in points), default=math.nan)


# -- collectives --------------------------------------------------------------------------------

# Bus bandwidth = algorithm bandwidth (bytes / time) x this factor of the group size (nccl-tests' convention):
# what each rank's link carries, comparable across group sizes.
BUS_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def collectives(device: Device, ranks: int, progress: Callable[[str], None], *, budget_s: float) -> list[dict]:
    """Bus GB/s and latency of each collective over ``ranks`` processes, one per device (gloo on the CPU,
    nccl on GPUs, hccl on NPUs), by message size (the full gathered tensor's bytes)."""
    import tempfile

    import torch.multiprocessing as mp

    sizes = [1 << e for e in range(14, 17 if device.quick else 25 if device.kind == "cpu" else 31, 2)]
    with tempfile.TemporaryDirectory(prefix="npu_inject_calibrate_") as folder:
        result = os.path.join(folder, "collectives.json")
        progress(f"collectives over {ranks} {device.kind} ranks: {', '.join(BUS_FACTOR)} from "
                 f"{sizes[0] >> 10} KiB to {sizes[-1] >> 20} MiB")
        mp.spawn(_collectives_rank, args=(ranks, device.kind, sizes, budget_s, os.path.join(folder, "store"), result),
                 nprocs=ranks, join=True)
        with open(result, encoding="utf-8") as handle:
            points = json.load(handle)
    for point in points:
        if point["bytes"] == sizes[-1]:
            progress(f"collective {point['op']}: {point['bus_gbps']:.4g} GB/s bus bandwidth at "
                     f"{point['bytes'] >> 20} MiB, {point['latency_us']:.3g} us at {sizes[0] >> 10} KiB")
    return points


def _collectives_rank(rank: int, ranks: int, kind: str, sizes: list[int], budget_s: float, store: str,
                      result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[kind]
    if kind == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(rank)
    elif kind == "cuda":
        torch.cuda.set_device(rank)
    on = torch.device(kind, rank) if kind != "cpu" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ranks)
    device = Device(kind, kind, "", on, ranks)
    points = []
    per_case = budget_s / (len(sizes) * len(BUS_FACTOR))
    for op in BUS_FACTOR:
        smallest = None
        for size in sizes:
            elements = size // 2
            full = torch.ones(elements, dtype=torch.bfloat16, device=on)
            part = torch.ones(elements // ranks, dtype=torch.bfloat16, device=on)
            run = {"all_gather": lambda: dist.all_gather_into_tensor(full, part),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
                   "all_reduce": lambda: dist.all_reduce(full),
                   "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full)}[op]
            # Every rank runs the same number of calls: rank 0 sizes them, the others take its count.
            count = torch.tensor([0], device=on if kind != "cpu" else "cpu")
            if rank == 0:
                run()
                device.sync()
                started = time.perf_counter()
                run()
                device.sync()
                once = time.perf_counter() - started
                count[0] = max(1, min(50, int(per_case / max(once, 1e-6))))
            else:
                run()
                run()
            dist.broadcast(count, 0)
            repeat = int(count.item())
            dist.barrier()
            device.sync()
            started = time.perf_counter()
            for _ in range(repeat):
                run()
            device.sync()
            seconds = (time.perf_counter() - started) / repeat
            smallest = seconds if smallest is None else smallest
            points.append({"op": op, "ranks": ranks, "bytes": size,
                           "bus_gbps": significant(size * BUS_FACTOR[op](ranks) / seconds / 1e9),
                           "latency_us": round(smallest * 1e6, 2)})
    if rank == 0:
        with open(result, "w", encoding="utf-8") as handle:
            json.dump(points, handle)
    dist.barrier()
    dist.destroy_process_group()
