"""Tensors on the simulated npu: placement, aliasing, copies, device checks."""

from __future__ import annotations

import pytest
import torch


def test_ways_to_put_a_tensor_on_the_npu() -> None:
    host = torch.arange(6.0)
    for tensor in (host.npu(), host.to("npu"), torch.arange(6.0, device="npu"), host.to(torch.device("npu", 0))):
        assert tensor.device == torch.device("npu", 0)
        assert tensor.is_npu
        assert torch.equal(tensor.cpu(), host)
    assert host.npu(1).device == torch.device("npu", 1)


def test_current_device_drives_placement() -> None:
    with torch.npu.device(1):
        assert torch.npu.current_device() == 1
        assert torch.empty(2, device="npu").device == torch.device("npu", 1)
    assert torch.npu.current_device() == 0
    torch.npu.set_device(1)
    assert torch.ones(1, device="npu").get_device() == 1


def test_invalid_device_index_is_rejected() -> None:
    count = torch.npu.device_count()
    with pytest.raises((RuntimeError, ValueError), match="Invalid npu device index"):
        torch.npu.set_device(count)


def test_views_alias_their_base() -> None:
    base = torch.zeros(4, 4, device="npu")
    base.view(16)[5] = 1.0
    base[2].fill_(2.0)
    base.t()[0].add_(10.0)  # column 0 of base, through a transposed view
    expected = torch.zeros(4, 4)
    expected.view(16)[5] = 1.0
    expected[2].fill_(2.0)
    expected[:, 0] += 10.0
    assert torch.equal(base.cpu(), expected)


def test_in_place_add_on_slice_is_visible_in_base_and_shares_storage() -> None:
    base = torch.arange(10.0, device="npu")
    window = base[2:5]
    window.add_(100.0)
    assert base.cpu().tolist()[2:5] == [102.0, 103.0, 104.0]
    assert window.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    parts = base.split(5)
    assert parts[1].storage_offset() == 5
    parts[1].zero_()
    assert base.cpu()[5:].eq(0).all()


def test_out_argument_is_resized_and_filled() -> None:
    a = torch.arange(6.0, device="npu").view(2, 3)
    out = torch.empty(0, device="npu")
    torch.mul(a, 2, out=out)
    assert out.shape == (2, 3)
    assert torch.equal(out.cpu(), torch.arange(6.0).view(2, 3) * 2)


def test_copies_between_host_and_devices() -> None:
    host = torch.randn(3, 5)
    on0 = host.to("npu:0")
    on1 = on0.to("npu:1")
    assert on1.device == torch.device("npu", 1)
    assert torch.equal(on1.cpu(), host)
    on1_t = on0.t().to("npu:1")  # non-contiguous source
    assert torch.equal(on1_t.cpu(), host.t())
    half = on0.to(torch.bfloat16)
    assert torch.equal(half.cpu(), host.to(torch.bfloat16))
    target = torch.empty(5, 3, device="npu:1")
    target.copy_(on0.t())
    assert torch.equal(target.cpu(), host.t())


def test_host_tensors_are_rejected_like_on_a_real_accelerator() -> None:
    device_tensor = torch.ones(3, device="npu")
    with pytest.raises(RuntimeError, match="same device"):
        device_tensor + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.matmul(torch.ones(2, 3, device="npu"), torch.ones(3, 2))
    with pytest.raises(RuntimeError, match="same device"):
        device_tensor + torch.ones(3, device="npu:1")
    # 0-dim host tensors act as scalars, and host indices are accepted, as on CUDA.
    assert torch.equal((device_tensor * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))
    assert torch.equal(torch.arange(5.0, device="npu")[torch.tensor([4, 0])].cpu(), torch.tensor([4.0, 0.0]))


def test_dynamic_shape_and_scalar_ops() -> None:
    values = torch.tensor([3, 1, 3, 0], device="npu")
    assert torch.nonzero(values).cpu().flatten().tolist() == [0, 1, 2]
    assert torch.unique(values).cpu().tolist() == [0, 1, 3]
    assert values.sum().item() == 7
    assert values.max().device == torch.device("npu", 0)


def test_untyped_storage_and_module_helpers() -> None:
    tensor = torch.ones(4, device="npu")
    assert tensor.untyped_storage().device == torch.device("npu", 0)
    assert tensor.untyped_storage().is_npu
    module = torch.nn.Linear(2, 2).npu()
    assert next(module.parameters()).device.type == "npu"


def test_conjugate_and_negative_views_copy_without_recursion() -> None:
    # copy_ of a conj/neg view used to recurse through the Conjugate fallback.
    values = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(values.conj().to("npu").cpu(), values.conj().resolve_conj())
    on_npu = values.to("npu").conj()
    assert torch.equal(on_npu.clone().cpu(), values.conj().resolve_conj())
    target = torch.empty(4, dtype=torch.complex64, device="npu")
    target.copy_(on_npu)
    assert torch.equal(target.cpu(), values.conj().resolve_conj())


def test_complex_rotary_backward_matches_cpu() -> None:
    # The shape of llama's RoPE: view_as_complex * freqs, backward through conj.
    real = torch.randn(3, 2)
    freqs = torch.polar(torch.ones(3), torch.arange(3.0))
    grads = []
    for device in ("cpu", "npu"):
        leaf = real.to(device).detach().requires_grad_()
        torch.view_as_real(torch.view_as_complex(leaf) * freqs.to(device)).sum().backward()
        grads.append(leaf.grad.cpu())
    assert torch.equal(grads[0], grads[1])


def test_efficient_zero_tensors_stay_zero_tensors() -> None:
    zeros = torch._efficientzerotensor(3, device="npu")
    assert zeros._is_zerotensor()
    assert torch.equal((zeros + 1).cpu(), torch.ones(3))


def test_lazy_clone_is_an_independent_copy() -> None:
    # torch_npu implements _lazy_clone for the NPU; spmd_types' replicate-to-varying calls it
    # (qwen3_5 MoE under PP + selective AC). It must read as a clone: equal now, apart after a write.
    source = torch.arange(6.0, device="npu").view(2, 3)
    copy = source._lazy_clone()
    assert copy.device == source.device and torch.equal(copy.cpu(), torch.arange(6.0).view(2, 3))
    copy.add_(1.0)
    assert torch.equal(source.cpu(), torch.arange(6.0).view(2, 3))
    assert torch.equal(copy.cpu(), torch.arange(6.0).view(2, 3) + 1)
