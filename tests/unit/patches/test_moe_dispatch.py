"""moe_dispatch: patched GroupedExperts and token dispatchers against independent PyTorch math.

Expected values come from Python loops over experts and tokens and from explicit
sorting written here; nothing is compared with npu_inject's ops glue or reference
kernels themselves. Shapes use odd expert counts, widths that are not multiples
of 8 (torch._grouped_mm's 16-byte alignment) and experts that receive no tokens.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import torch.nn.functional as F

from testkit import clean_env
from npu_inject import module_facts, runtime

PATCH_ID = "moe_dispatch"
MOE = "torchtitan.models.common.moe"
DISPATCHER = "torchtitan.models.common.token_dispatcher"


@pytest.fixture(scope="module")
def titan_moe():
    """torchtitan's MoE modules (imported once; slow)."""
    moe = importlib.import_module(MOE)
    token_dispatcher = importlib.import_module(DISPATCHER)
    return types.SimpleNamespace(moe=moe, td=token_dispatcher)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Names of the kernels the ops glue calls (the reference provider, counted)."""
    from npu_inject.ops import moe as moe_ops
    from npu_inject.ops import reference

    calls = []
    provider = types.ModuleType(reference.__name__)
    for name in reference.__all__:
        def counted(*args, _name=name, **kwargs):
            # group_type 2 left out: the K-grouping probe runs once per process (cached), which would make
            # the counts depend on test order.
            if kwargs.get("group_type") != 2:
                calls.append(_name)
            return getattr(reference, _name)(*args, **kwargs)

        setattr(provider, name, counted)
    monkeypatch.setattr(moe_ops, "kernels", lambda: provider)
    return calls


@pytest.fixture
def moe_patched(titan_moe, kernel_calls):
    """The runtime with only moe_dispatch selected, applied to the imported modules."""
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=PATCH_ID))
    importlib.import_module(MOE)
    record = rt.report.patches[PATCH_ID]
    assert record.state == "applied", record.reason
    return rt


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def expert_loop_matmul(x_RI, weight_EIO, counts):
    """Per expert: its consecutive rows times its matrix, products in float32, x's dtype out."""
    outs, start = [], 0
    for expert, count in enumerate(counts):
        rows = x_RI[start : start + count]
        outs.append((rows.float() @ weight_EIO[expert].float()).to(x_RI.dtype))
        start += count
    return torch.cat(outs)


# --------------------------------------------------------------------------------------
# Registry and lifecycle
# --------------------------------------------------------------------------------------


def _targets() -> list[str]:
    from npu_inject.patches import moe_dispatch

    return list(module_facts.declared_names(moe_dispatch))


def test_revert_restores_every_original(titan_moe):
    from npu_inject.patching import resolve_owner

    before = {}
    for target in _targets():
        owner, attribute = resolve_owner(target)
        before[target] = vars(owner)[attribute]
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=PATCH_ID))
    assert rt.report.patches[PATCH_ID].state == "applied"
    for target in _targets():
        owner, attribute = resolve_owner(target)
        assert vars(owner)[attribute] is not before[target], target
    runtime.deactivate()
    for target in _targets():
        owner, attribute = resolve_owner(target)
        assert vars(owner)[attribute] is before[target], target


# --------------------------------------------------------------------------------------
# Grouped matmul
# --------------------------------------------------------------------------------------

GROUPED_CASES = [
    # (dtype, counts per expert): odd expert counts, empty experts first/middle/last,
    # one expert holding every row, widths 12 -> 7 (not 16-byte aligned in bf16).
    (torch.float32, [0, 3, 0, 7, 2]),
    (torch.bfloat16, [4, 0, 5, 0, 1, 3, 0]),
    (torch.float32, [0, 0, 9]),
    (torch.bfloat16, [1]),
    (torch.bfloat16, [0, 0, 0]),  # no rows routed here (possible on an expert-parallel rank)
]


@pytest.mark.parametrize("dtype,counts", GROUPED_CASES)
def test_grouped_mm_matches_expert_loop_forward_and_grads(moe_patched, titan_moe, kernel_calls, dtype, counts):
    experts = titan_moe.moe.GroupedExperts(titan_moe.moe.GroupedExperts.Config(dim=12, hidden_dim=7, num_experts=len(counts)))
    rows = sum(counts)
    x_RI = _randn(rows, 12, seed=1, dtype=dtype).requires_grad_()
    w_EOI = _randn(len(counts), 7, 12, seed=2, dtype=dtype).requires_grad_()
    grad_RO = _randn(rows, 7, seed=3, dtype=dtype)

    y_RO = experts._grouped_mm(A=x_RI, B_t=w_EOI.transpose(-2, -1), offs=_offsets(counts))
    y_RO.backward(grad_RO)
    assert ("npu_grouped_matmul" in kernel_calls) == (rows > 0)  # no rows: no kernel call, zero gradients

    x_ref = x_RI.detach().clone().requires_grad_()
    w_ref = w_EOI.detach().clone().requires_grad_()
    expected_RO = expert_loop_matmul(x_ref, w_ref.transpose(-2, -1), counts)
    expected_RO.backward(grad_RO)

    assert y_RO.dtype == dtype and y_RO.shape == (rows, 7)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(y_RO, expected_RO, **tolerance)
    torch.testing.assert_close(x_RI.grad, x_ref.grad, **tolerance)
    torch.testing.assert_close(w_EOI.grad, w_ref.grad, **tolerance)
    for expert, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(w_EOI.grad[expert]) == 0


def test_grouped_experts_swiglu_matches_expert_loop(moe_patched, titan_moe):
    """The whole upstream GroupedExperts.forward (bf16 grouped GEMMs) over 5 experts, two empty."""
    counts = [3, 0, 6, 0, 2]
    module = titan_moe.moe.GroupedExperts(titan_moe.moe.GroupedExperts.Config(dim=12, hidden_dim=10, num_experts=5))
    with torch.no_grad():
        for index, param in enumerate((module.w1_EFD, module.w2_EDF, module.w3_EFD)):
            param.copy_(_randn(*param.shape, seed=10 + index) * 0.3)
    x_RD = _randn(sum(counts), 12, seed=4).requires_grad_()
    out_RD = module(x_RD, torch.tensor(counts))
    out_RD.square().sum().backward()

    params = [p.detach().clone().requires_grad_() for p in (module.w1_EFD, module.w2_EDF, module.w3_EFD)]
    w1, w2, w3 = params
    x_ref = x_RD.detach().clone().requires_grad_()
    outs, start = [], 0
    for expert, count in enumerate(counts):
        rows = x_ref[start : start + count].bfloat16()
        gate = (rows.float() @ w1[expert].bfloat16().float().t()).bfloat16()
        up = (rows.float() @ w3[expert].bfloat16().float().t()).bfloat16()
        hidden = F.silu(gate) * up
        outs.append((hidden.float() @ w2[expert].bfloat16().float().t()).bfloat16())
        start += count
    expected_RD = torch.cat(outs).float()
    expected_RD.square().sum().backward()

    assert out_RD.dtype == torch.float32
    torch.testing.assert_close(out_RD, expected_RD, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(x_RD.grad, x_ref.grad, atol=2e-2, rtol=2e-2)
    for param, ref in zip((module.w1_EFD, module.w2_EDF, module.w3_EFD), params):
        torch.testing.assert_close(param.grad, ref.grad, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(module.w1_EFD.grad[1]) == 0 and torch.count_nonzero(module.w2_EDF.grad[3]) == 0

@pytest.mark.parametrize("patches, offsets_dtype", [("moe_dispatch,swiglu", torch.int64), ("swiglu", torch.int32)])
def test_swiglu_makes_the_offsets_in_the_grouped_matmuls_dtype(titan_moe, monkeypatch, patches, offsets_dtype):
    """With moe_dispatch the offsets are born int64 (CANN's group_list, no cast per grouped matmul); without it
    int32, as upstream's torch._grouped_mm needs."""
    seen = []

    def recording_grouped_mm(A, B_t, offs):
        seen.append(offs.dtype)
        return torch.cat([A.new_zeros(0, B_t.shape[2])] + [
            A[start:end].float().matmul(B_t[e].float()).to(A.dtype)
            for e, (start, end) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))
        ])

    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=patches))
    importlib.import_module(MOE)
    for patch in patches.split(","):
        assert rt.report.patches[patch].state == "applied", rt.report.patches[patch].reason
    if "moe_dispatch" in patches:
        from npu_inject.ops import moe as moe_ops

        monkeypatch.setattr(moe_ops, "grouped_matmul_RO", lambda A, B_t, offs, **_: recording_grouped_mm(A, B_t, offs))
    else:
        monkeypatch.setattr(torch, "_grouped_mm", lambda A, B_t, offs: recording_grouped_mm(A, B_t, offs))
    module = titan_moe.moe.GroupedExperts(titan_moe.moe.GroupedExperts.Config(dim=16, hidden_dim=8, num_experts=3))
    module(_randn(7, 16, seed=5), torch.tensor([4, 0, 3]))
    assert seen == [offsets_dtype] * 3


def _recording_kernels(calls, *, groups_along_k=True):
    """The reference kernels, recording each grouped matmul's group_type; optionally without K grouping."""
    from npu_inject.ops import reference

    provider = types.ModuleType("test_recording_kernels" if groups_along_k else "test_kernels_without_k_grouping")

    def npu_grouped_matmul(x, weight, **kwargs):
        calls.append(kwargs["group_type"])
        if kwargs["group_type"] == 2 and not groups_along_k:
            raise NotImplementedError("group_type=2 is not implemented by this provider")
        return reference.npu_grouped_matmul(x, weight, **kwargs)

    provider.npu_grouped_matmul = npu_grouped_matmul
    return provider


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_backward_groups_weight_gradient_along_k(monkeypatch, dtype):
    """The reference groups along K: both gradients are kernel calls and match per-expert matmuls."""
    from npu_inject.ops import moe as moe_ops

    calls = []
    monkeypatch.setattr(moe_ops, "kernels", lambda: _recording_kernels(calls))
    assert moe_ops.kernel_backward_available(torch.device("cpu"), dtype)

    counts = [2, 0, 5, 1, 0]
    x_RI = _randn(8, 11, seed=5).to(dtype).requires_grad_()
    w_EIO = _randn(5, 11, 3, seed=6).to(dtype).requires_grad_()
    grad_RO = _randn(8, 3, seed=7).to(dtype)
    calls.clear()
    moe_ops.grouped_matmul_RO(x_RI, w_EIO, _offsets(counts), kernel_backward=True).backward(grad_RO)
    assert sorted(calls) == [0, 0, 2]  # forward, dx (along M), dweight (along K)

    x_ref = x_RI.detach().double().requires_grad_()
    w_ref = w_EIO.detach().double().requires_grad_()
    expert_loop_matmul(x_ref, w_ref, counts).backward(grad_RO.double())
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(x_RI.grad, x_ref.grad.to(dtype), **tolerance)
    torch.testing.assert_close(w_EIO.grad, w_ref.grad.to(dtype), **tolerance)


def test_reference_provider_runs_gradients_as_kernel_calls_without_a_fallback(moe_patched, titan_moe):
    from npu_inject.ops import moe as moe_ops

    assert moe_ops.kernel_backward_available(torch.device("cpu"), torch.bfloat16)
    experts = titan_moe.moe.GroupedExperts(titan_moe.moe.GroupedExperts.Config(dim=4, hidden_dim=3, num_experts=1))
    experts._grouped_mm(A=torch.ones(2, 4), B_t=torch.ones(1, 4, 3), offs=_offsets([2]))
    assert moe_patched.report.patches[PATCH_ID].fallbacks == []


def test_provider_without_k_grouping_differentiates_its_forward_and_reports_it(moe_patched, titan_moe, monkeypatch):
    from npu_inject.ops import moe as moe_ops

    monkeypatch.setattr(moe_ops, "kernels", lambda: _recording_kernels([], groups_along_k=False))
    assert not moe_ops.kernel_backward_available(torch.device("cpu"), torch.bfloat16)
    experts = titan_moe.moe.GroupedExperts(titan_moe.moe.GroupedExperts.Config(dim=4, hidden_dim=3, num_experts=1))
    x_RI = torch.ones(2, 4, requires_grad=True)
    experts._grouped_mm(A=x_RI, B_t=torch.ones(1, 4, 3), offs=_offsets([2])).sum().backward()
    (reason,) = moe_patched.report.patches[PATCH_ID].fallbacks
    assert "group_type=2" in reason and "autograd" in reason
    torch.testing.assert_close(x_RI.grad, torch.full((2, 4), 3.0))


def test_grouped_mm_without_offsets_runs_upstream_and_reports_it(moe_patched, titan_moe):
    experts = titan_moe.moe.GroupedExperts(titan_moe.moe.GroupedExperts.Config(dim=8, hidden_dim=16, num_experts=2))
    a_BMK = _randn(2, 4, 8, seed=8, dtype=torch.bfloat16)
    b_BKN = _randn(2, 8, 16, seed=9, dtype=torch.bfloat16)
    out = experts._grouped_mm(A=a_BMK, B_t=b_BKN, offs=None)
    torch.testing.assert_close(out.float(), torch.bmm(a_BMK.float(), b_BKN.float()), atol=5e-2, rtol=2e-2)
    assert any("torch._grouped_mm" in reason for reason in moe_patched.report.patches[PATCH_ID].fallbacks)


# --------------------------------------------------------------------------------------
# Token dispatch and combine
# --------------------------------------------------------------------------------------


def _routing(T, K, E, seed, unused_experts):
    """Distinct top-k expert ids per token, avoiding ``unused_experts``; positive scores."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in unused_experts])
    ids_TK = torch.stack([allowed[torch.randperm(len(allowed), generator=generator)[:K]] for _ in range(T)])
    scores_TK = torch.rand(T, K, generator=generator) + 0.1
    return ids_TK, scores_TK


def explicit_moe_layer(x_TD, scores_TK, ids_TK, expert_scale_E):
    """out[t] = sum_k score[t,k] * expert(ids[t,k])(x[t]) with expert e(x) = tanh(x) * scale[e]."""
    rows = []
    for t in range(x_TD.shape[0]):
        total = torch.zeros_like(x_TD[t])
        for k in range(ids_TK.shape[1]):
            total = total + scores_TK[t, k] * torch.tanh(x_TD[t]) * expert_scale_E[ids_TK[t, k]]
        rows.append(total)
    return torch.stack(rows)


def explicit_expert_sort(ids_TK):
    """(token, k) slots ordered by expert id, ties in slot order, by a plain Python sort."""
    K = ids_TK.shape[1]
    slots = sorted(range(ids_TK.numel()), key=lambda slot: (int(ids_TK[slot // K, slot % K]), slot))
    return slots


@pytest.mark.parametrize("E,K,T,unused", [(5, 2, 9, {1}), (7, 3, 6, {0, 6}), (3, 1, 4, {2})])
def test_local_dispatch_and_combine_match_explicit_math(moe_patched, titan_moe, kernel_calls, E, K, T, unused):
    td = titan_moe.td
    dispatcher = td.LocalTokenDispatcher(td.LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    ids_TK, scores_TK = _routing(T, K, E, seed=E, unused_experts=unused)
    scores_TK.requires_grad_()
    x_TD = _randn(T, 6, seed=11).requires_grad_()
    scale_E = torch.arange(1, E + 1, dtype=torch.float32)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)

    routed_ND, counts_out_E, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
    slots = explicit_expert_sort(ids_TK)
    assert torch.equal(routed_ND, x_TD.detach()[[slot // K for slot in slots]])
    assert metadata.token_indices_experts_sorted_N.tolist() == [slot // K for slot in slots]
    assert torch.equal(counts_out_E, counts_E)
    expert_of_row_N = torch.repeat_interleave(torch.arange(E), counts_E)
    assert expert_of_row_N.tolist() == [int(ids_TK[s // K, s % K]) for s in slots]

    routed_out_ND = torch.tanh(routed_ND) * scale_E[expert_of_row_N].unsqueeze(-1)
    out_TD = dispatcher.combine(routed_out_ND, metadata, x_TD)
    grad_TD = _randn(T, 6, seed=12)
    out_TD.backward(grad_TD)
    assert kernel_calls == ["npu_moe_token_permute", "npu_moe_token_unpermute"]

    x_ref = x_TD.detach().clone().requires_grad_()
    scores_ref = scores_TK.detach().clone().requires_grad_()
    expected_TD = explicit_moe_layer(x_ref, scores_ref, ids_TK, scale_E)
    expected_TD.backward(grad_TD)
    torch.testing.assert_close(out_TD, expected_TD)
    torch.testing.assert_close(x_TD.grad, x_ref.grad)
    torch.testing.assert_close(scores_TK.grad, scores_ref.grad)


def test_local_combine_keeps_input_dtype_for_bf16_tokens(moe_patched, titan_moe):
    td = titan_moe.td
    dispatcher = td.LocalTokenDispatcher(td.LocalTokenDispatcher.Config(num_experts=3, top_k=2))
    ids_TK, scores_TK = _routing(5, 2, 3, seed=3, unused_experts=set())
    x_TD = _randn(5, 4, seed=13, dtype=torch.bfloat16)
    routed_ND, _, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, torch.bincount(ids_TK.reshape(-1), minlength=3))
    out_TD = dispatcher.combine(routed_ND, metadata, x_TD)
    expected_TD = (x_TD.float() * scores_TK.sum(-1, keepdim=True)).bfloat16()
    assert out_TD.dtype == torch.bfloat16
    torch.testing.assert_close(out_TD, expected_TD, atol=1e-2, rtol=1e-2)


class _FakeEPMesh:
    """Only what _permute/_unpermute ask of the expert-parallel mesh: its size."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


@pytest.mark.parametrize("ep_size,counts", [(2, [2, 0, 1, 3, 0, 2]), (3, [1, 0, 0, 2, 1, 0]), (2, [0, 0, 0, 0])])
def test_expert_major_permute_and_unpermute_match_explicit_order(moe_patched, titan_moe, kernel_calls, ep_size, counts):
    td = titan_moe.td
    dispatcher = td.AllToAllTokenDispatcher(td.AllToAllTokenDispatcher.Config(num_experts=len(counts), top_k=1))
    dispatcher.ep_mesh = _FakeEPMesh(ep_size)
    local = len(counts) // ep_size
    R = sum(counts)
    rows_RD = _randn(R, 5, seed=14).requires_grad_()
    counts_E = torch.tensor(counts)

    input_shape, permuted_RD, permuted_indices_R, counts_e = dispatcher._permute(rows_RD, counts_E)

    # Rank-major segments (rank r, local expert e) in arrival order, regrouped expert-major.
    segments, start = {}, 0
    for rank in range(ep_size):
        for expert in range(local):
            count = counts[rank * local + expert]
            segments[(rank, expert)] = list(range(start, start + count))
            start += count
    expected_order = [row for expert in range(local) for rank in range(ep_size) for row in segments[(rank, expert)]]
    assert tuple(input_shape) == (R, 5)
    assert permuted_indices_R.tolist() == expected_order
    assert torch.equal(permuted_RD, rows_RD.detach()[expected_order])
    assert counts_e.tolist() == [sum(counts[rank * local + e] for rank in range(ep_size)) for e in range(local)]

    restored_RD = dispatcher._unpermute(permuted_RD * 2, input_shape, permuted_indices_R)
    torch.testing.assert_close(restored_RD, rows_RD.detach() * 2)
    assert kernel_calls == (["npu_moe_token_permute", "npu_moe_token_unpermute"] if R else [])
    if R:
        restored_RD.sum().backward()
        torch.testing.assert_close(rows_RD.grad, torch.full_like(rows_RD, 2.0))


def test_expert_parallel_unpermute_gathers_under_compile(moe_patched, kernel_calls):
    """torch_npu 2.14.0's unpermute without probs fails compiled (tests/cann_emu/test_moe.py): compiled, the
    rank-major unpermutation is a gather, checked against upstream's scatter (out[indices[p]] = rows[p])."""
    from npu_inject.ops import moe as moe_ops

    rows_RD = _randn(6, 5, seed=15).requires_grad_()
    permuted_indices_R = torch.tensor([3, 0, 5, 1, 4, 2])
    compiled = torch.compile(moe_ops.rank_major_unpermutation, backend="aot_eager", fullgraph=True)
    restored_RD = compiled(rows_RD, permuted_indices_R)
    expected_RD = torch.zeros(6, 5)
    expected_RD[permuted_indices_R] = rows_RD.detach()
    torch.testing.assert_close(restored_RD, expected_RD)
    (restored_RD * torch.arange(6.0).unsqueeze(1)).sum().backward()
    torch.testing.assert_close(rows_RD.grad, permuted_indices_R.float().unsqueeze(1).expand(6, 5))
    assert "npu_moe_token_unpermute" not in kernel_calls


def test_all_to_all_dispatcher_on_a_one_rank_ep_group_matches_explicit_math(
    moe_patched, titan_moe, kernel_calls, monkeypatch, tmp_path
):
    """Dispatch, exchange (gloo all_to_all_single), expert-major permute and combine on EP=1 of a real group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as dist_utils

    monkeypatch.setattr(dist_utils, "_spmd_backend", "partial_dtensor")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        td = titan_moe.td
        E, K, T = 5, 2, 7
        dispatcher = td.AllToAllTokenDispatcher(td.AllToAllTokenDispatcher.Config(num_experts=E, top_k=K))
        dispatcher.wire_meshes(ep_mesh=mesh)
        ids_TK, scores_TK = _routing(T, K, E, seed=21, unused_experts={3})
        scores_TK.requires_grad_()
        x_TD = _randn(T, 4, seed=22).requires_grad_()
        scale_E = torch.arange(1, E + 1, dtype=torch.float32)
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)

        routed_RD, counts_e, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
        assert torch.equal(counts_e, counts_E)
        expert_of_row_R = torch.repeat_interleave(torch.arange(E), counts_e)
        out_TD = dispatcher.combine(torch.tanh(routed_RD) * scale_E[expert_of_row_R].unsqueeze(-1), metadata, x_TD)
        out_TD.sum().backward()
        # local reorder, expert-major permute, its undoing, and the scored combine
        assert kernel_calls == ["npu_moe_token_permute"] * 2 + ["npu_moe_token_unpermute"] * 2

        x_ref = x_TD.detach().clone().requires_grad_()
        scores_ref = scores_TK.detach().clone().requires_grad_()
        explicit_moe_layer(x_ref, scores_ref, ids_TK, scale_E).sum().backward()
        torch.testing.assert_close(out_TD, explicit_moe_layer(x_TD.detach(), scores_TK.detach(), ids_TK, scale_E))
        torch.testing.assert_close(x_TD.grad, x_ref.grad)
        torch.testing.assert_close(scores_TK.grad, scores_ref.grad)
    finally:
        dist.destroy_process_group()


def test_probe_under_the_planners_fake_tensors_asks_the_planning_kernels(request):
    """npu-inject plan records under a FakeTensorMode: the probe must ask the NPU kernels' fakes (which group
    along K, as CANN does), not compute the reference on fake tensors (its group_list read is data-dependent)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_inject import selection
    from npu_inject.ops import moe as moe_ops

    selection.establish({"TORCHTITAN_NPU": "cpu"})
    request.addfinalizer(selection.forget)
    moe_ops._groups_along_k.cache_clear()
    request.addfinalizer(moe_ops._groups_along_k.cache_clear)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert moe_ops.kernels().__name__ == "npu_inject.ops.planning"
        assert moe_ops.kernel_backward_available(torch.device("cpu"), torch.bfloat16)
