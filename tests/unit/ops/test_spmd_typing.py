"""Our ops under spmd_types type checking (torchtitan's ``--debug.spmd_typechecking``), on 2 gloo ranks.

torchtitan runs the forward inside ``spmd_types.checker.typecheck`` with its dense mesh current:
every op must see typed tensors and every autograd Function must be registered. Each case
runs one of our ops there, on inputs typed as torchtitan's attention / MoE code types them,
and checks (a) no SpmdTypeError, (b) the output's type is what upstream's equivalent gives
(attention: the query's; all-to-all: V; all-gather: R), (c) the values equal the same call
without type checking. Metadata tensors (document ends) are made outside the checked region,
as torchtitan builds attention masks before the forward.
"""

from __future__ import annotations

import torch

from gloo import run_on_gloo_ranks

WORLD, B, L, N, H = 2, 2, 16, 4, 8


def _checked(mesh, fn):
    """fn() inside the type-checked region torchtitan's train step opens (local mode, as inner attention)."""
    import spmd_types as spmd
    from spmd_types.checker import typecheck

    with spmd.set_current_mesh(mesh), typecheck():
        return fn()


def _typed(mesh, tensor, axis_type):
    import spmd_types as spmd

    with spmd.set_current_mesh(mesh):
        spmd.assert_type(tensor, {axis: axis_type for axis in spmd.current_mesh()})
    return tensor


def _type_on(mesh, tensor):
    import spmd_types as spmd

    with spmd.set_current_mesh(mesh):
        # The mesh's one axis (spmd_types names it after its process group).
        return [str(t) for t in spmd.get_local_type(tensor).values()]


def _worker(rank: int) -> list[str]:  # noqa: C901
    from npu_inject import selection

    selection.establish({"TORCHTITAN_NPU": "cpu"})
    import spmd_types as spmd
    from torch.distributed.device_mesh import init_device_mesh

    from npu_inject.ops import kernels
    from npu_inject.ops.attention import AttentionPlan, document_plan, fusion_attention_BLNH
    from npu_inject.ops.cp import ContextParallelPlan, _AllGather, context_parallel_attention_BLNH
    from npu_inject.ops.moe import _GroupedMatmulKernelBackward

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    V, R = str(spmd.V), str(spmd.R)
    failures = []

    def check(label, got, want, got_type, want_type):
        if got_type != want_type:
            failures.append(f"{label}: SPMD type {got_type}, expected {want_type}")
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            failures.append(f"{label}: max diff {(got - want).abs().max().item():.2e} from the unchecked call")

    def attempt(label, fn):
        try:
            return fn()
        except spmd.SpmdTypeError as error:
            failures.append(f"{label}: {type(error).__name__}: {str(error).splitlines()[0]}")
            return None

    generator = torch.Generator().manual_seed(11 + rank)
    q, k, v = (torch.randn(B, L, N, H, generator=generator) for _ in range(3))

    # Packed-document fusion attention: the ends tensor is made untyped, before the checked region.
    packed = document_plan(causal=True, window=None, document_ends=(5, 16, 25, 32))
    for name, attention_plan in (("causal", AttentionPlan()), ("packed", packed)):
        want, want_lse = fusion_attention_BLNH(q, k, v, attention_plan, None, return_lse=True)
        tq, tk, tv = (_typed(mesh, t.clone(), spmd.V) for t in (q, k, v))
        got = attempt(f"fusion_attention/{name}",
                      lambda: _checked(mesh, lambda: fusion_attention_BLNH(tq, tk, tv, attention_plan, None,
                                                                          return_lse=True)))
        if got is not None:
            check(f"fusion_attention/{name}/out", got[0], want, _type_on(mesh, got[0]), [V])
            check(f"fusion_attention/{name}/lse", got[1], want_lse, _type_on(mesh, got[1]), [V])

    # Context parallel: query rows sharded (V); key/value sharded (V) or already gathered by
    # upstream's inner-attention boundary (R, whole sequence, rank after rank).
    chunk = L // (2 * WORLD)

    def headtail(r):
        return list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * WORLD - 1 - r) * chunk,
                                                                      (2 * WORLD - r) * chunk))
    local, balanced = headtail(rank), tuple(p for r in range(WORLD) for p in headtail(r))
    whole = torch.Generator().manual_seed(5)
    q_all, k_all, v_all = (torch.randn(B, L, N, H, generator=whole) for _ in range(3))
    for scheme in ("ulysses", "allgather"):
        cp = ContextParallelPlan(AttentionPlan(), None, tuple(local), balanced, scheme, group)
        want = context_parallel_attention_BLNH(q_all[:, local], k_all[:, local], v_all[:, local], cp, cp.plan, None)
        for layout in ("sharded", "gathered"):
            rows = local if layout == "sharded" else list(balanced)
            kv_type = spmd.V if layout == "sharded" else spmd.R
            tq = _typed(mesh, q_all[:, local].clone(), spmd.V)
            tk, tv = (_typed(mesh, t[:, rows].clone(), kv_type) for t in (k_all, v_all))
            got = attempt(f"cp/{scheme}/{layout}", lambda: _checked(
                mesh, lambda: context_parallel_attention_BLNH(tq, tk, tv, cp, cp.plan, None)))
            if got is not None:
                check(f"cp/{scheme}/{layout}", got, want, _type_on(mesh, got), [V])

    # The all-gather turns V into R; it refuses an input typed R (already whole on every rank).
    shard = _typed(mesh, torch.full((2, 3), float(rank)), spmd.V)
    gathered = attempt("all_gather", lambda: _checked(mesh, lambda: _AllGather.apply(shard, group)))
    if gathered is not None:
        check("all_gather", gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(WORLD)]),
              _type_on(mesh, gathered), [R])
    replicated = _typed(mesh, torch.ones(2, 3), spmd.R)
    try:
        _checked(mesh, lambda: _AllGather.apply(replicated, group))
        failures.append("all_gather of an R tensor: no SpmdTypeError")
    except spmd.SpmdTypeError:
        pass

    # MoE token permute (the rehearsal's reference builds untyped scratch tensors inside).
    x_TD = torch.randn(6, 8, generator=generator)
    ids_TK = torch.randint(0, 4, (6, 2), generator=generator, dtype=torch.int32)
    want_rows, want_slots = kernels().npu_moe_token_permute(x_TD, ids_TK)
    tx, tids = _typed(mesh, x_TD.clone(), spmd.V), _typed(mesh, ids_TK.clone(), spmd.V)
    got = attempt("npu_moe_token_permute",
                  lambda: _checked(mesh, lambda: kernels().npu_moe_token_permute(tx, tids)))
    if got is not None:
        check("npu_moe_token_permute/rows", got[0], want_rows, _type_on(mesh, got[0]), [V])
        if not torch.equal(got[1], want_slots):
            failures.append("npu_moe_token_permute/slots differ from the unchecked call")

    # Grouped matmul with kernel gradients (our autograd Function, registered as local).
    x_RI = torch.randn(6, 4, generator=generator)
    weight_EIO = torch.randn(3, 4, 5, generator=generator)
    group_list_E = torch.tensor([2, 2, 6], dtype=torch.int64)
    want = _GroupedMatmulKernelBackward.apply(x_RI, weight_EIO, group_list_E)
    tx, tw, tg = (_typed(mesh, t.clone(), spmd.V) for t in (x_RI, weight_EIO, group_list_E))
    got = attempt("grouped_matmul", lambda: _checked(mesh, lambda: _GroupedMatmulKernelBackward.apply(tx, tw, tg)))
    if got is not None:
        check("grouped_matmul", got, want, _type_on(mesh, got), [V])

    return failures


def test_ops_under_spmd_type_checking_keep_upstream_types_and_values():
    results = run_on_gloo_ranks(_worker, WORLD)
    failures = [f"rank {rank}: {f}" for rank in range(WORLD) for f in results[rank]]
    assert not failures, "\n".join(failures)
