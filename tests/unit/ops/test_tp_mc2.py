"""torch's symm_mem fused TP ops through npu_inject.ops.tp_mc2 on 2 gloo ranks vs. the collective and the matmul
done separately (all_gather_into_tensor / reduce_scatter_tensor and torch.matmul), and the MC2 decision.

bf16 inputs take the MC2 kernels (the reference npu_all_gather_base_mm / npu_mm_reduce_scatter_base);
float32 and k < 256 take the plain path, with the reason reported.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gloo import run_on_gloo_ranks

WORLD = 2


def _worker(rank: int) -> tuple[list[str], list[str]]:
    from npu_inject import selection

    selection.establish({"TORCHTITAN_NPU": "cpu"})
    import torch.distributed._symmetric_memory  # noqa: F401 - defines the ops

    from npu_inject.ops import tp_mc2

    library = torch.library.Library("symm_mem", "IMPL")
    for name, kernel in tp_mc2.KERNELS.items():
        library.impl(name, kernel, "CPU")
    reasons: list[str] = []
    tp_mc2.on_fallback = reasons.append
    group_name = dist.group.WORLD.group_name
    failures = []
    generator = torch.Generator().manual_seed(3)
    for dtype, k, gather_dim in ((torch.bfloat16, 256, 0), (torch.bfloat16, 256, 1), (torch.float32, 256, 0),
                                 (torch.bfloat16, 128, 0)):
        # all-gather + matmul: A (2, 4, k) per rank gathered along gather_dim, two Bs
        a_full = torch.randn(2, 8, k, generator=generator).to(dtype) if gather_dim == 1 else \
            torch.randn(8, 4, k, generator=generator).to(dtype)
        bs = [torch.randn(k, n, generator=generator).to(dtype) for n in (48, 16)]
        shard = a_full.chunk(WORLD, dim=gather_dim)[rank].contiguous()
        gathered, outputs = torch.ops.symm_mem.fused_all_gather_matmul(shard, bs, gather_dim, group_name)
        expected = [(a_full.float() @ b.float()).to(dtype) for b in bs]
        if not torch.equal(gathered, a_full):
            failures.append(f"{dtype} k={k} gather_dim={gather_dim}: gathered A differs")
        for got, want in zip(outputs, expected):
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
                failures.append(f"{dtype} k={k} gather_dim={gather_dim}: A @ B differs")
        # matmul + reduce-scatter along dim 0: each rank's partial product, summed, rows scattered
        x_parts = [torch.randn(8, k, generator=generator).to(dtype) for _ in range(WORLD)]
        w = torch.randn(k, 24, generator=generator).to(dtype)
        out = torch.ops.symm_mem.fused_matmul_reduce_scatter(x_parts[rank], w, "sum", 0, group_name)
        total = sum((x.float() @ w.float()).to(dtype).float() for x in x_parts)
        want = total.chunk(WORLD, dim=0)[rank]
        if out.shape != want.shape or not torch.allclose(out.float(), want, rtol=1e-2, atol=0.5):
            failures.append(f"{dtype} k={k}: reduce-scattered product differs by "
                            f"{(out.float() - want).abs().max().item():.3g}")
    return failures, reasons


def test_fused_ops_match_the_collective_and_the_matmul_done_separately():
    results = run_on_gloo_ranks(_worker, WORLD)
    failures = [f for rank in range(WORLD) for f in results[rank][0]]
    reasons = results[0][1]
    assert not failures, "\n".join(failures)
    # bf16 with k=256 ran on the MC2 kernels; float32 and k=128 each said why they did not.
    assert sorted(set(reasons)) == [
        "fused_all_gather_matmul: dtype torch.float32/torch.float32 (MC2 takes float16 or bfloat16): "
        "all-gather + matmul",
        "fused_all_gather_matmul: k=128 (MC2 takes k in [256, 65535)): all-gather + matmul",
        "fused_matmul_reduce_scatter: dtype torch.float32/torch.float32 (MC2 takes float16 or bfloat16): "
        "matmul + reduce-scatter",
        "fused_matmul_reduce_scatter: k=128 (MC2 takes k in [256, 65535)): matmul + reduce-scatter",
    ], reasons


def _hcom_worker(rank: int) -> list[str]:
    import socket

    import torch.distributed.distributed_c10d as c10d

    from npu_inject.ops.reference import mc2

    scans = []
    scan = mc2._scan_for_hcom
    mc2._scan_for_hcom = lambda hcom: scans.append(hcom) or scan(hcom)
    failures = []
    world = dist.group.WORLD
    name = world.group_name
    if not (mc2.group_for_hcom(name) is world and mc2.group_for_hcom(name) is world and scans == [name]):
        failures.append(f"a live group is found by one scan: scans {scans}")
    # Destroyed and created again: c10d hands out the same name to another group object.
    dist.destroy_process_group()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    again = dist.group.WORLD
    if again is world or again.group_name != name:
        failures.append(f"setup: expected a new group named {name!r}, got {again.group_name!r}")
    if mc2.group_for_hcom(name) is not again or scans != [name, name]:
        failures.append(f"after the group was recreated the cache answered {mc2.group_for_hcom(name)} "
                        f"(scans {scans}), not the new group")
    if world in c10d._world.pg_names:
        failures.append("setup: the destroyed group is still registered")
    return failures


def test_the_hcom_lookup_scans_once_per_group_and_follows_a_recreated_group():
    failures = run_on_gloo_ranks(_hcom_worker, 1)[0]
    assert not failures, failures


def test_one_refusal_names_each_constraint_once():
    from npu_inject.ops.tp_mc2 import mc2_refusal

    a = torch.empty(6, 4, 256, dtype=torch.bfloat16, device="meta")
    b = torch.empty(256, 16, dtype=torch.bfloat16, device="meta")
    assert mc2_refusal(a, b, 4, axis=0, scatter=True) == "m=6 (the scatter axis) not divisible by 4 ranks"
    assert mc2_refusal(a, b, 2, axis=0, scatter=True) is None  # 3 rows per rank
    assert mc2_refusal(a, b, 4, axis=1, scatter=True) is None  # the scatter axis of 4 rows divides
    assert mc2_refusal(a, b, 2, axis=-1, scatter=True) == "scatters the K axis (MC2 scatters rows)"
    assert mc2_refusal(a, b, 2, axis=2, scatter=False) == "gathers the K axis (MC2 gathers rows)"
    assert mc2_refusal(a, b, 2, axis=0, scatter=True, reduce_op="avg") == "reduce_op 'avg' (MC2 sums)"
    assert mc2_refusal(a, b, 4, axis=0, scatter=False) is None  # gathering needs no divisible rows


@pytest.mark.parametrize("shape,dtype,world,scatter,expected", [
    ((8, 256), torch.bfloat16, 2, False, None),
    ((8, 256), torch.float16, 8, True, None),
    ((8, 256), torch.float32, 2, False, "dtype"),
    ((8, 255), torch.bfloat16, 2, False, "k=255"),
    ((8, 65535), torch.bfloat16, 2, False, "k=65535"),
    ((8, 256), torch.bfloat16, 3, False, "3 ranks"),
    ((6, 256), torch.bfloat16, 4, True, "m=6"),
])
def test_mc2_refusal_follows_the_documented_constraints(shape, dtype, world, scatter, expected):
    from npu_inject.ops.tp_mc2 import mc2_refusal

    a = torch.empty(shape, dtype=dtype, device="meta")
    b = torch.empty(shape[1], 16, dtype=dtype, device="meta")
    refusal = mc2_refusal(a, b, world, axis=0, scatter=scatter)
    assert refusal is None if expected is None else expected in refusal
