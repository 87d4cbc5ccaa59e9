"""One decoder layer in plain PyTorch, forward and backward, timed: what ``npu-inject plan``'s
``time_by_module["layers.N"]`` is held against (docs/planner.md, "Checked against a real accelerator").

The layer is torchtitan's llama3 block written out with torch alone (no torchtitan, no npu_inject), so it
runs wherever torch does: attention_norm (RMSNorm) -> wq/wk/wv -> rotary embedding -> causal GQA
attention (SDPA) -> wo -> residual; ffn_norm -> w1, w3 -> silu(w1) * w3 -> w2 -> residual. No activation
checkpointing. ``--model qwen3_30b_a3b``: Qwen3-30B-A3B's MoE layer as torchtitan 0.3.0 runs it on a GPU
(one wqkv projection, RMSNorm on each head's q and k, GQA; the router's gate in float32, softmax, top 8 of
128 experts, scores renormalised; tokens sorted by expert, ``torch._grouped_mm`` for w1, w3 and w2 without
padding, the weighted sum back with index_add). Device time by CUDA/NPU events, the mean of --repeat steps
after warm-up; with --profile, the kernels' time by class (matmul, grouped, attention, other) from
torch.profiler.

    python tools/bench_layer.py                          # llama3_8b's layer, local batch 2 x seq 8192, bf16
    python tools/bench_layer.py --model qwen3_30b_a3b    # its MoE layer, local batch 2 x seq 4096, bf16
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
# torchtitan 0.3.0's qwen3 "30B-A3B" flavor (models/qwen3/__init__.py) and its config's seq_len 4096.
QWEN3_30B_A3B = {"dim": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "top_k": 8,
                 "expert_hidden": 768, "rope_theta": 1000000.0}
QWEN3_TINY = {"dim": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "experts": 8, "top_k": 2,
              "expert_hidden": 64, "rope_theta": 1000000.0}
MODELS = {"llama3_8b": (LLAMA3_8B, TINY, 8192), "qwen3_30b_a3b": (QWEN3_30B_A3B, QWEN3_TINY, 4096)}


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

    def attend(self, q_BNLH, k_BNLH, v_BNLH):
        """Causal GQA attention by SDPA, on ``self.backend`` when one is set."""
        if self.backend is None:
            return F.scaled_dot_product_attention(q_BNLH, k_BNLH, v_BNLH, is_causal=True, enable_gqa=True)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([self.backend]):
            return F.scaled_dot_product_attention(q_BNLH, k_BNLH, v_BNLH, is_causal=True, enable_gqa=True)

    def forward(self, x_BLD: torch.Tensor, cos_LH, sin_LH) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        h_BLD = self.attention_norm(x_BLD)
        q_BLNH = self.wq(h_BLD).view(B, L, self.heads, self.head_dim)
        k_BLNH = self.wk(h_BLD).view(B, L, self.kv_heads, self.head_dim)
        v_BLNH = self.wv(h_BLD).view(B, L, self.kv_heads, self.head_dim)
        q_BLNH, k_BLNH = self.rotate(q_BLNH, cos_LH, sin_LH), self.rotate(k_BLNH, cos_LH, sin_LH)
        out_BNLH = self.attend(*(t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH)))
        x_BLD = x_BLD + self.wo(out_BNLH.transpose(1, 2).reshape(B, L, -1))
        h_BLD = self.ffn_norm(x_BLD)
        return x_BLD + self.w2(F.silu(self.w1(h_BLD)) * self.w3(h_BLD))


class Qwen3MoELayer(Layer):
    """Qwen3's MoE decoder layer: Layer's attention with a fused wqkv and q/k norms, routed experts for the FFN."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int,
                 expert_hidden: int, rope_theta: float) -> None:
        torch.nn.Module.__init__(self)
        self.heads, self.kv_heads, self.head_dim, self.top_k = heads, kv_heads, head_dim, top_k
        self.attention_norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.q_norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
        self.wo = torch.nn.Linear(heads * head_dim, dim, bias=False)
        self.ffn_norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        scale = dim ** -0.5
        self.w1_EFD = torch.nn.Parameter(torch.randn(experts, expert_hidden, dim) * scale)
        self.w3_EFD = torch.nn.Parameter(torch.randn(experts, expert_hidden, dim) * scale)
        self.w2_EDF = torch.nn.Parameter(torch.randn(experts, dim, expert_hidden) * expert_hidden ** -0.5)
        self.rope_theta = rope_theta
        self.backend = None

    def experts(self, h_TD: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=h_TD.device.type, enabled=False):
            scores_TE = F.linear(h_TD.float(), self.gate.weight.float()).softmax(dim=-1)
        top_scores_TK, expert_TK = scores_TE.topk(self.top_k, dim=-1)
        top_scores_TK = top_scores_TK / top_scores_TK.sum(dim=-1, keepdim=True)
        order_R = expert_TK.flatten().argsort(stable=True)
        token_R = order_R // self.top_k
        tokens_per_expert_E = torch.bincount(expert_TK.flatten(), minlength=self.w1_EFD.shape[0])
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        x_RD = h_TD[token_R]
        h_RF = F.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets_E)
        y_RD = torch._grouped_mm(h_RF, self.w2_EDF.transpose(-2, -1), offs=offsets_E)
        y_RD = y_RD * top_scores_TK.flatten()[order_R, None].to(y_RD.dtype)
        return torch.zeros_like(h_TD).index_add(0, token_R, y_RD)

    def forward(self, x_BLD: torch.Tensor, cos_LH, sin_LH) -> torch.Tensor:
        B, L, D = x_BLD.shape
        qkv_BLX = self.wqkv(self.attention_norm(x_BLD))
        q_BLNH, k_BLNH, v_BLNH = qkv_BLX.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                                self.kv_heads * self.head_dim], dim=-1)
        q_BLNH = self.q_norm(q_BLNH.view(B, L, self.heads, self.head_dim))
        k_BLNH = self.k_norm(k_BLNH.view(B, L, self.kv_heads, self.head_dim))
        v_BLNH = v_BLNH.view(B, L, self.kv_heads, self.head_dim)
        q_BLNH, k_BLNH = self.rotate(q_BLNH, cos_LH, sin_LH), self.rotate(k_BLNH, cos_LH, sin_LH)
        out_BNLH = self.attend(*(t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH)))
        x_BLD = x_BLD + self.wo(out_BNLH.transpose(1, 2).reshape(B, L, -1))
        return x_BLD + self.experts(self.ffn_norm(x_BLD).view(B * L, D)).view(B, L, D)


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


def kernel_classes(layer: Layer, x_BLD, grad_BLD, rope, device, top: int = 20) -> tuple[dict[str, float], list]:
    """Device milliseconds of one forward + backward by kernel class (torch.profiler's kernel names), and the
    ``top`` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        layer(x_BLD, *rope).backward(grad_BLD)
        if device.type == "cuda":
            torch.cuda.synchronize()
    classes = {"matmul": 0.0, "grouped": 0.0, "attention": 0.0, "other": 0.0}
    by_name: dict[str, float] = {}
    for event in prof.events():
        if device.type == "cuda" and event.device_type.name != "CUDA":
            continue
        name = event.name.lower()
        duration = (event.device_time if device.type == "cuda" else event.cpu_time) / 1e3  # us -> ms
        if device.type == "cpu" and not name.startswith("aten::") or event.cpu_parent is not None and device.type == "cpu":
            continue
        by_name[event.name] = by_name.get(event.name, 0.0) + duration
        if "group" in name:
            classes["grouped"] += duration
        elif any(word in name for word in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            classes["attention"] += duration
        elif any(word in name for word in ("gemm", "xmma", "cutlass", "nvjet", "aten::mm", "aten::addmm", "aten::linear", "matmul")):
            classes["matmul"] += duration
        else:
            classes["other"] += duration
    # The kernels behind the classes, so a misclassified name shows (device ms, longest first).
    kernels_by_time = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {name: round(value, 3) for name, value in classes.items()}, [[name[:120], round(ms, 3)] for name, ms in kernels_by_time]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3_8b")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="default: 8192 for llama3_8b, 4096 for qwen3_30b_a3b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="the model's layer at dim 256: a smoke test")
    parser.add_argument("--attention", nargs="*", default=["default"],
                        help="SDPA backends to time: default (SDPA's choice), flash, cudnn, efficient, math")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also the kernels' time by class")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    full, tiny, seq = MODELS[args.model]
    shape = tiny if args.tiny else full
    args.seq = args.seq or seq
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = (Layer if args.model == "llama3_8b" else Qwen3MoELayer)(**shape).to(device=device, dtype=dtype)
    x_BLD = torch.randn(args.batch, args.seq, shape["dim"], device=device, dtype=dtype, requires_grad=True)
    grad_BLD = torch.randn_like(x_BLD)
    rope = layer.rotary(args.seq, device)
    tokens = args.batch * args.seq
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else str(device),
              "torch": torch.__version__, "model": args.model, "shape": shape, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
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
            run["kernels_ms"], run["top_kernels_ms"] = kernel_classes(layer, x_BLD, grad_BLD, rope, device)
        result["runs"][name] = run
        print(f"{name}: forward {run['forward_ms']:.2f} ms, forward + backward {run['forward_backward_ms']:.2f} ms"
              + (f", kernels {run['kernels_ms']}" if args.profile else ""), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
