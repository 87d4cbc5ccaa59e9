"""npu_inject.ops.reference.npu_grouped_matmul against per-group torch.matmul loops.

The reference implements the two scenarios npu_inject.ops.moe calls (one 2-D x, one 3-D
weight, an int64 group_list tensor, group_type=0, one output; and the weight gradient's
group_type=2: x stored transposed, a 2-D weight, one (E, M, N) output); every other
documented scenario must raise NotImplementedError rather than compute something else.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kernelkit import KW, NODEF, POS, cumsum, randn
from npu_inject.ops import reference as ref


# _op_plugin_docs.py, "npu_grouped_matmul", 接口原型 (tuning_config has no default there;
# the schema in csrc/aten/npu_native_functions_by_codegen.yaml gives None).
DOCUMENTED_SIGNATURE = [
    ("x", POS, NODEF), ("weight", POS, NODEF), ("bias", KW, None), ("scale", KW, None), ("offset", KW, None),
    ("antiquant_scale", KW, None), ("antiquant_offset", KW, None), ("per_token_scale", KW, None),
    ("group_list", KW, None), ("activation_input", KW, None), ("activation_quant_scale", KW, None),
    ("activation_quant_offset", KW, None), ("split_item", KW, 0), ("group_type", KW, None),
    ("group_list_type", KW, 0), ("act_type", KW, 0), ("output_dtype", KW, None), ("tuning_config", KW, None),
]


def test_signature_matches_docs():
    parameters = inspect.signature(ref.npu_grouped_matmul).parameters.values()
    assert [(p.name, p.kind, p.default) for p in parameters] == DOCUMENTED_SIGNATURE


def loop_gmm(x_MK, w_EKN, counts):
    rows, start = [], 0
    for e, c in enumerate(counts):
        rows.append(x_MK[start : start + c].double() @ w_EKN[e].double())
        start += c
    return torch.cat(rows)


@pytest.mark.parametrize("counts", [[3, 0, 5, 0, 2], [0, 0, 4], [7], [1, 2, 3, 4, 5, 6, 7]])
@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("split_item", [2, 3])
def test_gmm_moe_path(counts, group_list_type, split_item):
    m, k, n = sum(counts), 6, 5
    x, w = randn(m, k, seed=70), randn(len(counts), k, n, seed=71)
    group_list = torch.tensor(cumsum(counts) if group_list_type == 0 else counts, dtype=torch.int64)
    (y,) = ref.npu_grouped_matmul([x], [w], group_list=group_list, split_item=split_item, group_type=0,
                                  group_list_type=group_list_type)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), loop_gmm(x, w, counts), atol=1e-5, rtol=1e-5)


def test_gmm_gradients_match_loop():
    counts = [4, 0, 3, 5, 1]
    m, k, n = sum(counts), 6, 4
    x0, w0, g = randn(m, k, seed=72), randn(5, k, n, seed=73), randn(m, n, seed=74)
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (y,) = ref.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor(counts), split_item=3, group_type=0, group_list_type=1
    )
    (y * g).sum().backward()
    xr, wr = x0.double().requires_grad_(True), w0.double().requires_grad_(True)
    (loop_gmm(xr, wr, counts) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=1e-5, rtol=1e-5)
    assert torch.all(w.grad[1] == 0)  # the empty group gets no gradient


def test_gmm_bf16_accumulates_in_fp32():
    counts = [5, 3]
    x, w = randn(8, 64, seed=75, dtype=torch.bfloat16), randn(2, 64, 16, seed=76, dtype=torch.bfloat16)
    (y,) = ref.npu_grouped_matmul([x], [w], group_list=torch.tensor(cumsum(counts)), split_item=3, group_type=0)
    assert y.dtype == torch.bfloat16
    # Exact fp32 accumulation rounded once to bf16.
    torch.testing.assert_close(y, loop_gmm(x, w, counts).float().bfloat16(), atol=0, rtol=0)


@pytest.mark.parametrize(
    "scenario",
    ["list_group_list", "weight_list", "bias", "several_x", "no_grouping", "group_along_n"],
)
def test_gmm_unimplemented_scenarios_raise(scenario):
    # Documented scenarios npu_inject never calls: refused by name, never approximated.
    x, w = randn(6, 4, seed=77), randn(2, 4, 3, seed=78)
    group_list = torch.tensor([2, 6])
    call = {
        "list_group_list": lambda: ref.npu_grouped_matmul([x], list(w), group_list=[2, 6], split_item=2),
        "weight_list": lambda: ref.npu_grouped_matmul([x], list(w), group_list=group_list, split_item=3, group_type=0),
        "bias": lambda: ref.npu_grouped_matmul([x], [w], bias=[randn(2, 3)], group_list=group_list, split_item=3,
                                               group_type=0),
        "several_x": lambda: ref.npu_grouped_matmul([x[:2], x[2:]], [w], group_list=group_list, split_item=3,
                                                    group_type=0),
        "no_grouping": lambda: ref.npu_grouped_matmul([x[:2], x[2:]], list(w), group_type=-1),
        "group_along_n": lambda: ref.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=1),
    }[scenario]
    with pytest.raises(NotImplementedError, match="not implemented in the reference"):
        call()


def test_gmm_uncovered_tail_rows_are_zero():
    x, w = randn(10, 4, seed=93), randn(2, 4, 3, seed=94)
    (y,) = ref.npu_grouped_matmul(
        [x], [w], group_list=torch.tensor([3, 4]), split_item=3, group_type=0, group_list_type=1
    )
    torch.testing.assert_close(y[:7].double(), loop_gmm(x, w, [3, 4]), atol=1e-5, rtol=1e-5)
    assert torch.all(y[7:] == 0)


@pytest.mark.parametrize(
    "kwarg", ["scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale", "activation_input",
              "activation_quant_scale", "activation_quant_offset"],
)
def test_gmm_quant_args_not_implemented(kwarg):
    x, w = randn(4, 4), randn(1, 4, 4)
    with pytest.raises(NotImplementedError, match=kwarg):
        ref.npu_grouped_matmul([x], [w], group_list=torch.tensor([4]), split_item=3, group_type=0, **{kwarg: [x]})


def test_gmm_errors():
    x, w = randn(6, 4), randn(2, 4, 3)
    gl = torch.tensor([2, 6])
    with pytest.raises(ValueError, match="group_type=0"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3)
    with pytest.raises(ValueError, match="split_item=2 or 3"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=0, group_type=0)
    with pytest.raises(ValueError, match="covers 9 rows"):
        ref.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 5]), split_item=3, group_type=0, group_list_type=1)
    with pytest.raises(ValueError, match="non-decreasing"):
        ref.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 2]), split_item=3, group_type=0)
    with pytest.raises(ValueError, match="output_dtype"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, output_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="list of tensors"):
        ref.npu_grouped_matmul(x, [w], group_list=gl, split_item=3, group_type=0)
    with pytest.raises(NotImplementedError, match="act_type"):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, act_type=1)
    # output_dtype restating x's dtype is fine, as a torch.dtype or an at::ScalarType code.
    for od in (torch.float32, 6):
        ref.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, output_dtype=od)


def loop_gmm_along_k(x_MK, w_KN, counts):
    blocks, start = [], 0
    for c in counts:
        blocks.append(x_MK[:, start : start + c].double() @ w_KN[start : start + c].double())
        start += c
    return torch.stack(blocks)


@pytest.mark.parametrize("counts", [[3, 0, 5, 0, 2], [0, 0, 4], [7], [1, 2, 3, 4, 5, 6, 7]])
@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gmm_along_k_is_the_per_group_product_of_the_ks(counts, group_list_type, dtype):
    k, m, n = sum(counts), 6, 5
    x_KM, w_KN = randn(k, m, seed=80).to(dtype), randn(k, n, seed=81).to(dtype)
    group_list = torch.tensor(cumsum(counts) if group_list_type == 0 else counts, dtype=torch.int64)
    (y,) = ref.npu_grouped_matmul([x_KM.t()], [w_KN], group_list=group_list, split_item=3, group_type=2,
                                  group_list_type=group_list_type)
    assert y.dtype == dtype and y.shape == (len(counts), m, n)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(y, loop_gmm_along_k(x_KM.t(), w_KN, counts).to(dtype), **tolerance)
    for group, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(y[group]) == 0


def test_gmm_along_k_refuses_cann_s_invalid_layouts():
    x_KM, w_KN, group_list = randn(6, 4, seed=82), randn(6, 3, seed=83), torch.tensor([2, 6])
    with pytest.raises(ValueError, match="x stored transposed"):
        ref.npu_grouped_matmul([x_KM.t().contiguous()], [w_KN], group_list=group_list, split_item=3, group_type=2)
    with pytest.raises(ValueError, match="can not be transposed at the same time"):
        ref.npu_grouped_matmul([x_KM.t()], [w_KN.t().contiguous().t()], group_list=group_list, split_item=3,
                               group_type=2)
    with pytest.raises(ValueError, match="covers 7 of K"):
        ref.npu_grouped_matmul([x_KM.t()], [w_KN], group_list=torch.tensor([2, 7]), split_item=3, group_type=2)
    with pytest.raises(ValueError, match="same K"):
        ref.npu_grouped_matmul([x_KM.t()], [w_KN[:5]], group_list=group_list, split_item=3, group_type=2)
    with pytest.raises(NotImplementedError, match="lists of weights"):
        ref.npu_grouped_matmul([x_KM.t()], [randn(2, 6, 3)], group_list=group_list, split_item=3, group_type=2)
