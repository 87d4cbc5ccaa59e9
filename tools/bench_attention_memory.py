"""Host memory of the CPU rehearsal's reference attention (figures only, no assertion).

    python tools/bench_attention_memory.py kernel [--seq 2048 4096 8192] [--before REV]
    python tools/bench_attention_memory.py rehearsal [--seq 2048 8192] [--steps 2]

``kernel``: one forward + backward of the reference ``npu_fusion_attention`` (BSND,
causal sparse_mode 2 with the compressed mask, float32) at the llama3 debug model's
attention shape (batch 1, 16 heads of dim 16), each in a fresh interpreter: peak RSS
(ru_maxrss), its rise over the RSS once the inputs exist, and the wall time. With
``--before REV`` the same is measured for ``npu_inject/ops/reference/fusion_attention.py``
as it was at git revision REV (loaded from ``git show``), for comparison; ``--cap-gib``
bounds the address space of every measured interpreter so that a quadratic implementation
fails with an allocation error instead of exhausting the machine.

``rehearsal``: ``TORCHTITAN_NPU=cpu`` torchrun of llama3_debugmodel on 2 ranks, local
batch 1, fp32, per ``--seq``: the peak RSS of each rank (VmHWM polled from /proc every
0.2 s) and the losses. torchtitan's language models attend within documents (block
causal), and tests/assets/c4_test's documents are ~200 tokens, so attention there is
never longer than that; ``--documents long`` (the default) trains on the same text joined
into documents of ~64 originals (over 10k tokens), so every sequence attends causally
over its full length, as a corpus with long documents does. It runs the working tree as
it is: to measure an older reference, check that file out first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

from npu_inject.commands.suite import LOSS_LINE  # torchtitan's training metric line, as the suite reads it

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_PATH = "npu_inject/ops/reference/fusion_attention.py"
HEADS, HEAD_DIM = 16, 16  # torchtitan llama3 debugmodel: dim 256, 16 heads


def _rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))


def measure_kernel(seq: int, revision: str | None) -> dict:
    """In this interpreter: one forward + backward at ``seq`` tokens (called in a fresh child)."""
    import importlib.util

    import torch

    from npu_inject import selection

    selection.establish({"TORCHTITAN_NPU": "cpu"})
    if revision is None:
        from npu_inject.ops.reference import fusion_attention as module
    else:
        source = subprocess.run(["git", "show", f"{revision}:{REFERENCE_PATH}"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
        path = os.path.join(tempfile.mkdtemp(prefix="bench_attention_"), "fusion_attention_before.py")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(source)
        spec = importlib.util.spec_from_file_location("fusion_attention_before", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, HEADS, HEAD_DIM, generator=generator).requires_grad_(True) for _ in range(3))
    grad_out = torch.randn(1, seq, HEADS, HEAD_DIM, generator=generator)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    baseline_kib = _rss_kib()
    started = time.perf_counter()
    out, *_ = module.npu_fusion_attention(q, k, v, HEADS, "BSND", atten_mask=mask, sparse_mode=2,
                                          scale=HEAD_DIM ** -0.5)
    out.backward(grad_out)
    wall_s = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": peak_kib / 1024, "rise_mib": (peak_kib - baseline_kib) / 1024, "wall_s": wall_s}


def run_kernel_child(seq: int, revision: str | None, cap_gib: float) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {REPO!r}); sys.path.insert(0, {os.path.join(REPO, 'tools')!r});"
            f"import bench_attention_memory as b; print('RESULT', json.dumps(b.measure_kernel({seq}, {revision!r})))")
    cap = int(cap_gib * 2**30)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("TORCHTITAN_NPU", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            preexec_fn=limit)
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit {result.returncode}: {last[:160]}"}


def kernel(args) -> None:
    print(f"reference npu_fusion_attention, forward + backward, BSND causal (sparse_mode 2), float32, "
          f"batch 1, {HEADS} heads x dim {HEAD_DIM}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, "
          f"address space capped at {args.cap_gib} GiB")
    versions = [("working tree", None)] + ([(f"at {args.before}", args.before)] if args.before else [])
    for seq in args.seq:
        for label, revision in versions:
            result = run_kernel_child(seq, revision, args.cap_gib)
            if "error" in result:
                print(f"  seq {seq:6d}  {label:24s}  failed: {result['error']}")
            else:
                print(f"  seq {seq:6d}  {label:24s}  peak RSS {result['peak_mib']:8.0f} MiB  "
                      f"rise {result['rise_mib']:8.0f} MiB  time {result['wall_s']:6.1f} s")


def _descendants(root: int) -> list[int]:
    children, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as handle:
                found = [int(p) for p in handle.read().split()]
        except FileNotFoundError:
            continue
        children += found
        frontier += found
    return children


def _peak_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            status = handle.read()
    except FileNotFoundError:
        return None
    name = re.search(r"^Name:\s*(\S+)", status, re.M).group(1)
    hwm = re.search(r"^VmHWM:\s*(\d+)", status, re.M)
    return None if hwm is None or not name.startswith("python") else int(hwm.group(1)) / 1024


def _long_documents(folder: str, joined: int = 64) -> str:
    """tests/assets/c4_test's text with every ``joined`` consecutive documents made one document."""
    with open(os.path.join(REPO, "tests", "assets", "c4_test", "data.json"), encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle if line.strip()]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "data.json"), "w", encoding="utf-8") as handle:
        for start in range(0, len(texts), joined):
            handle.write(json.dumps({"text": " ".join(texts[start:start + joined])}) + "\n")
    return folder


def rehearsal(args) -> None:
    print(f"llama3_debugmodel CPU rehearsal (TORCHTITAN_NPU=cpu), 2 ranks, local batch 1, fp32, {args.steps} steps, "
          f"{args.documents} documents" + (f", address space capped at {args.cap_gib} GiB per process"
                                           if args.cap_gib else ""))
    cap = None if not args.cap_gib else int(args.cap_gib * 2**30)

    def limit():
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    for seq in args.seq:
        with tempfile.TemporaryDirectory(prefix="bench_attention_") as dump:
            data = [] if args.documents == "c4_test" else \
                ["--dataloader.dataset_path", _long_documents(os.path.join(dump, "long_documents"))]
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                       "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
                       "--training.steps", str(args.steps), "--training.seq_len", str(seq),
                       "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable",
                       "--debug.seed", "42", "--training.mixed_precision_param", "float32", "--dump_folder", dump, *data]
            env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}
            env.update(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1")
            log_path = os.path.join(dump, "log.txt")
            started = time.perf_counter()
            with open(log_path, "w", encoding="utf-8") as log:
                process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           preexec_fn=limit)
                peaks: dict[int, float] = {}
                while process.poll() is None:
                    for pid in _descendants(process.pid):
                        peak = _peak_rss_mib(pid)
                        if peak is not None:
                            peaks[pid] = max(peaks.get(pid, 0.0), peak)
                    time.sleep(0.2)
            wall_s = time.perf_counter() - started
            with open(log_path, encoding="utf-8") as handle:
                output = handle.read()
            losses = {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(output)}
            ranks = ", ".join(f"{peak:.0f}" for peak in sorted(peaks.values(), reverse=True)[:2])
            failure = [line for line in output.splitlines() if "Error" in line][-1:] or output.splitlines()[-1:]
            state = "ok" if process.returncode == 0 else f"FAILED (exit {process.returncode}): {failure[0][:200]}"
            print(f"  seq_len {seq:6d}  peak RSS per rank {ranks} MiB  losses {losses}  wall {wall_s:.0f} s  {state}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    kernel_parser = sub.add_parser("kernel", help="one forward + backward of the reference attention")
    kernel_parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    kernel_parser.add_argument("--before", help="git revision whose reference to measure as well")
    kernel_parser.add_argument("--cap-gib", type=float, default=12.0,
                               help="address-space limit of each measured interpreter (GiB)")
    rehearsal_parser = sub.add_parser("rehearsal", help="2-rank llama3_debugmodel rehearsal")
    rehearsal_parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    rehearsal_parser.add_argument("--steps", type=int, default=2)
    rehearsal_parser.add_argument("--documents", choices=("long", "c4_test"), default="long")
    rehearsal_parser.add_argument("--cap-gib", type=float, default=0.0,
                                  help="address-space limit of every process of the run (GiB; 0: none)")
    args = parser.parse_args()
    kernel(args) if args.what == "kernel" else rehearsal(args)


if __name__ == "__main__":
    main()
