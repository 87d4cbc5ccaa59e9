"""One Llama 3 decoder layer in plain PyTorch, forward and backward, timed: what ``npu-inject plan``'s
``time_by_module["layers.N"]`` is held against (docs/planner.md, "Checked against a real accelerator").

The layer is torchtitan's llama3 block written out with torch alone (no torchtitan, no npu_inject), so it
runs wherever torch does: attention_norm (RMSNorm) -> wq/wk/wv -> rotary embedding -> causal GQA
attention (SDPA) -> wo -> residual; ffn_norm -> w1, w3 -> silu(w1) * w3 -> w2 -> residual. No activation
checkpointing. Device time by CUDA/NPU events, the mean of --repeat steps after warm-up; with --profile,
the kernels' time by class (matmul, attention, other) from torch.profiler.

    python tools/bench_layer.py                          # llama3_8b's layer, local batch 2 x seq 8192, bf16
    python tools/bench_layer.py --attention flash cudnn  # SDPA backends (default: SDPA's own choice)
    python tools/bench_layer.py --tiny --device cpu      # a small shape on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

LLAMA3_8B = {"dim": 4096, "heads": 32, "kv_heads": 8, "hidden": 14336, "rope_theta": 500000.0}
TINY = {"dim": 256, "heads": 16, "kv_heads": 4, "hidden": 768, "rope_theta": 500000.0}


class Layer(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, rope_theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.wq = torch.nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * self.head_dim, dim, bias=False)
        self.ffn_norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.rope_theta = rope_theta
        self.backend = None

    def rotary(self, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        frequencies = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)
        angles_LH = torch.outer(torch.arange(seq, device=device).float(), frequencies)
        return angles_LH.cos(), angles_LH.sin()

    @staticmethod
    def rotate(x_BLNH: torch.Tensor, cos_LH: torch.Tensor, sin_LH: torch.Tensor) -> torch.Tensor:
        # torchtitan's complex rotation of (even, odd) pairs, in real arithmetic.
        x = x_BLNH.float().unflatten(-1, (-1, 2))
        even, odd = x[..., 0], x[..., 1]
        cos, sin = cos_LH[None, :, None, :], sin_LH[None, :, None, :]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x_BLNH)

    def forward(self, x_BLD: torch.Tensor, cos_LH, sin_LH) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        h_BLD = self.attention_norm(x_BLD)
        q_BLNH = self.wq(h_BLD).view(B, L, self.heads, self.head_dim)
        k_BLNH = self.wk(h_BLD).view(B, L, self.kv_heads, self.head_dim)
        v_BLNH = self.wv(h_BLD).view(B, L, self.kv_heads, self.head_dim)
        q_BLNH, k_BLNH = self.rotate(q_BLNH, cos_LH, sin_LH), self.rotate(k_BLNH, cos_LH, sin_LH)
        q_BNLH, k_BNLH, v_BNLH = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if self.backend is None:
            out_BNLH = F.scaled_dot_product_attention(q_BNLH, k_BNLH, v_BNLH, is_causal=True, enable_gqa=True)
        else:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel([self.backend]):
                out_BNLH = F.scaled_dot_product_attention(q_BNLH, k_BNLH, v_BNLH, is_causal=True, enable_gqa=True)
        x_BLD = x_BLD + self.wo(out_BNLH.transpose(1, 2).reshape(B, L, -1))
        h_BLD = self.ffn_norm(x_BLD)
        return x_BLD + self.w2(F.silu(self.w1(h_BLD)) * self.w3(h_BLD))


def _events(device: torch.device):
    return torch.cuda if device.type == "cuda" else getattr(torch, device.type, None)


def step_seconds(layer: Layer, x_BLD, grad_BLD, rope, device, *, backward: bool, repeat: int, warmup: int) -> float:
    def step():
        out = layer(x_BLD, *rope)
        if backward:
            out.backward(grad_BLD)

    for _ in range(warmup):
        step()
    if device.type == "cpu":
        started = time.perf_counter()
        for _ in range(repeat):
            step()
        return (time.perf_counter() - started) / repeat
    events = _events(device)
    events.synchronize()
    begin, end = events.Event(enable_timing=True), events.Event(enable_timing=True)
    begin.record()
    for _ in range(repeat):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / repeat


def kernel_classes(layer: Layer, x_BLD, grad_BLD, rope, device) -> dict[str, float]:
    """Device milliseconds of one forward + backward by kernel class (torch.profiler's kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        layer(x_BLD, *rope).backward(grad_BLD)
        if device.type == "cuda":
            torch.cuda.synchronize()
    classes = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.events():
        if device.type == "cuda" and event.device_type.name != "CUDA":
            continue
        name = event.name.lower()
        duration = (event.device_time if device.type == "cuda" else event.cpu_time) / 1e3  # us -> ms
        if device.type == "cpu" and not name.startswith("aten::") or event.cpu_parent is not None and device.type == "cpu":
            continue
        if any(word in name for word in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            classes["attention"] += duration
        elif any(word in name for word in ("gemm", "xmma", "cutlass", "nvjet", "aten::mm", "aten::addmm", "aten::linear", "matmul")):
            classes["matmul"] += duration
        else:
            classes["other"] += duration
    return {name: round(value, 3) for name, value in classes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="dim 256, 16 heads: a smoke test")
    parser.add_argument("--attention", nargs="*", default=["default"],
                        help="SDPA backends to time: default (SDPA's choice), flash, cudnn, efficient, math")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also the kernels' time by class")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else LLAMA3_8B
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = Layer(**shape).to(device=device, dtype=dtype)
    x_BLD = torch.randn(args.batch, args.seq, shape["dim"], device=device, dtype=dtype, requires_grad=True)
    grad_BLD = torch.randn_like(x_BLD)
    rope = layer.rotary(args.seq, device)
    tokens = args.batch * args.seq
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else str(device),
              "torch": torch.__version__, "shape": shape, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
              "tokens": tokens, "runs": {}}
    backends = {"default": None}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        backends.update(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION,
                        efficient=SDPBackend.EFFICIENT_ATTENTION, math=SDPBackend.MATH)
    for name in args.attention:
        if name not in backends:
            parser.error(f"--attention {name}: one of {', '.join(backends)} on {device.type}")
        layer.backend = backends[name]
        try:
            forward = step_seconds(layer, x_BLD.detach(), grad_BLD, rope, device, backward=False,
                                   repeat=args.repeat, warmup=args.warmup)
            both = step_seconds(layer, x_BLD, grad_BLD, rope, device, backward=True, repeat=args.repeat,
                                warmup=args.warmup)
        except RuntimeError as exc:
            print(f"{name}: not run: {str(exc).splitlines()[0]}")
            continue
        run = {"forward_ms": round(forward * 1e3, 3), "forward_backward_ms": round(both * 1e3, 3)}
        if args.profile:
            run["kernels_ms"] = kernel_classes(layer, x_BLD, grad_BLD, rope, device)
        result["runs"][name] = run
        print(f"{name}: forward {run['forward_ms']:.2f} ms, forward + backward {run['forward_backward_ms']:.2f} ms"
              + (f", kernels {run['kernels_ms']}" if args.profile else ""), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
