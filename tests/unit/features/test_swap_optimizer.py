"""Swap Optimizer: bit-identical to plain torch.optim, checkpoints interchangeable.

Every expected value comes from an unswapped ``torch.optim`` optimizer trained on an
identical model; nothing is compared with the swap machinery itself. The device-side
checks (pinned host state, stream order, the memory bound) run on the simulated NPU in a
child process, with its audit on.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

from npu_inject import runtime
from npu_inject.errors import ConfigError
from npu_inject.features import swap_optimizer as swap
from testkit import clean_env, sim_env

from testkit import REPO  # noqa: E402
IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
HOST = torch.device("cpu")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24), torch.nn.Linear(24, 3)
    )


def _train(model, optimizer, steps, seed=7, scheduler=None):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 12, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _assert_same_params(a, b):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"{name} differs"


def _assert_same_state(expected, actual):
    assert expected["param_groups"] == actual["param_groups"]
    assert expected["state"].keys() == actual["state"].keys()
    for index, state in expected["state"].items():
        assert list(state) == list(actual["state"][index]), "state keys or their order differ"
        for key, value in state.items():
            assert value.shape == actual["state"][index][key].shape
            assert torch.equal(value, actual["state"][index][key]), f"state[{index}][{key}] differs"


def test_slices_are_contiguous_balanced_and_never_empty():
    params = [torch.empty(n) for n in (100, 10, 10, 80, 50, 50, 100, 1)]
    for count in (1, 2, 3, 4, 8, 20):
        parts = swap.slice_parameters(params, count)
        assert [p for part in parts for p in part] == params  # contiguous, in order, all present
        assert all(parts) and len(parts) <= count
        total = sum(p.numel() for p in params)
        biggest = max(p.numel() for p in params)
        assert max(sum(p.numel() for p in part) for part in parts) <= total / count + biggest
    with pytest.raises(ValueError, match="positive integer"):
        swap.slice_parameters(params, 0)


def _timeline(order, durations):
    """When each slice occupies the arena, on a device that runs the side stream's copies
    one after another and the compute stream's updates one after another; an update
    starts once its slice's prefetch ended, a copy-out once its update ended.
    Returns {slice: (prefetch start, copy-out end)}."""
    side_free = compute_free = 0.0
    prefetched, occupied = {}, {}
    for kind, index in order:
        if kind == "prefetch":
            start = side_free
            side_free = prefetched[index] = start + durations["prefetch"][index]
            occupied[index] = [start, None]
        else:
            update_end = max(compute_free, prefetched[index]) + durations["update"][index]
            compute_free = update_end
            side_free = max(side_free, update_end) + durations["copy-out"][index]
            occupied[index][1] = side_free
    return occupied


def test_arena_schedule_never_overlaps_live_slices_and_stays_within_the_goal():
    """Random slice sizes and copy/update durations: slices that are in the arena at the same
    time never share bytes, and the arena stays within its budget."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(400):
        count = int(torch.randint(1, 10, (1,), generator=generator))
        sizes = [512 * int(n) for n in torch.randint(0, 40, (count,), generator=generator)]
        budget = max(sizes) + sum(sizes) // count  # the swap's goal: 1/k of the state + one slice
        capacity, bases, collides = swap.arena_layout(sizes, budget)
        assert capacity <= budget, (sizes, capacity)
        order = swap.side_stream_order(collides)
        assert sorted(order) == sorted([("prefetch", i) for i in range(count)] + [("copy-out", i) for i in range(count)])
        for index in range(count):
            assert order.index(("prefetch", index)) < order.index(("copy-out", index))
            assert 0 <= bases[index] and bases[index] + sizes[index] <= capacity
            assert bases[index] % 512 == 0, "dtype views of the arena need aligned offsets"
        durations = {kind: torch.rand(count, generator=generator).tolist() for kind in ("prefetch", "update", "copy-out")}
        occupied = _timeline(order, durations)
        for a in range(count):
            for b in range(a + 1, count):
                (a0, a1), (b0, b1) = occupied[a], occupied[b]
                at_once = a0 < b1 and b0 < a1
                share = bases[a] < bases[b] + sizes[b] and bases[b] < bases[a] + sizes[a]
                assert not (at_once and share and sizes[a] and sizes[b]), (trial, sizes, a, b)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("slices", [1, 2, 4, 8])
def test_adamw_bit_identical(implementation, slices):
    flags = IMPLEMENTATIONS[implementation]
    plain_model, swapped_model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=3e-3, weight_decay=0.1, **flags)
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=3e-3, weight_decay=0.1, **flags)
    swap.install(swapped, slices, HOST, None)
    # An LR schedule changes group hyperparameters between steps; the slices must see them.
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (plain, swapped)]
    for step in range(5):
        _train(plain_model, plain, 1, seed=step, scheduler=schedulers[0])
        _train(swapped_model, swapped, 1, seed=step, scheduler=schedulers[1])
        _assert_same_params(plain_model, swapped_model)
    _assert_same_state(plain.state_dict(), swapped.state_dict())


def test_sgd_momentum_and_adam_amsgrad_bit_identical():
    for build in (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
                  lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True)):
        plain_model, swapped_model = _model(), _model()
        plain, swapped = build(plain_model.parameters()), build(swapped_model.parameters())
        swap.install(swapped, 3, HOST, None)
        _train(plain_model, plain, 4)
        _train(swapped_model, swapped, 4)
        _assert_same_params(plain_model, swapped_model)
        _assert_same_state(plain.state_dict(), swapped.state_dict())


def test_step_hooks_run_once_per_step_and_closure_is_honoured():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    swap.install(optimizer, 4, HOST, None)
    calls = []
    optimizer.register_step_pre_hook(lambda *a: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *a: calls.append("post"))

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 12)).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert calls == ["pre", "post"] and isinstance(loss, torch.Tensor)


def test_unsupported_optimizer_is_refused_by_name():
    with pytest.raises(TypeError, match="per-parameter updates .* not Adagrad"):
        swap.install(torch.optim.Adagrad(_model().parameters()), 2, HOST, None)


def test_state_dicts_load_across_swapped_and_plain():
    """plain -> swapped and swapped -> plain, then training continues identically."""
    reference_model = _model()
    reference = torch.optim.AdamW(reference_model.parameters(), lr=2e-3)
    _train(reference_model, reference, 6)

    writer_model = _model()
    writer = torch.optim.AdamW(writer_model.parameters(), lr=2e-3)
    _train(writer_model, writer, 3)

    swapped_model = _model()
    swapped_model.load_state_dict(writer_model.state_dict())
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=2e-3)
    swap.install(swapped, 4, HOST, None)
    # deepcopy: torch's load_state_dict keeps same-device tensors as they are (aliasing the source)
    swapped.load_state_dict(copy.deepcopy(writer.state_dict()))
    _train(swapped_model, swapped, 3, seed=8)

    back_model = _model()
    back_model.load_state_dict(swapped_model.state_dict())
    back = torch.optim.AdamW(back_model.parameters(), lr=2e-3)
    back.load_state_dict(copy.deepcopy(swapped.state_dict()))

    _train(writer_model, writer, 3, seed=8)
    _assert_same_params(writer_model, swapped_model)
    _assert_same_state(writer.state_dict(), swapped.state_dict())
    _assert_same_state(writer.state_dict(), back.state_dict())


def _container(model, slices=None):
    from torchtitan.components.optimizer import default_adamw

    container = default_adamw(lr=2e-3).build(model_parts=[model])
    if slices is not None:
        swap.install(container.optimizers[0], slices, HOST, None)
    return container


@pytest.mark.parametrize("direction", ["swapped_to_plain", "plain_to_swapped"])
def test_dcp_checkpoints_are_interchangeable(tmp_path, direction):
    """torchtitan's flat optimizer state through plain DCP, written by one kind, read by the other."""
    write_slices, read_slices = (3, None) if direction == "swapped_to_plain" else (None, 3)
    writer_model = _model()
    writer = _container(writer_model, write_slices)
    _train(writer_model, writer, 3)
    dcp.save({"optimizer": writer, "model": writer_model.state_dict()}, checkpoint_id=str(tmp_path))

    reader_model = _model(seed=1)
    reader = _container(reader_model, read_slices)
    model_state = reader_model.state_dict()
    dcp.load({"optimizer": reader, "model": model_state}, checkpoint_id=str(tmp_path))
    reader_model.load_state_dict(model_state)

    _assert_same_params(writer_model, reader_model)
    assert writer.state_dict().keys() == reader.state_dict().keys()
    for key, value in writer.state_dict().items():
        other = reader.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    _train(writer_model, writer, 2, seed=9)
    _train(reader_model, reader, 2, seed=9)
    _assert_same_params(writer_model, reader_model)


def test_patch_swaps_torchtitan_optimizers_with_the_configured_slices(tmp_path):
    user_registry = tmp_path / "registry.json"
    user_registry.write_text(json.dumps(
        {"schema": 1, "patches": {"swap_optimizer": {"default": True, "options": {"slices": 3}}}}
    ))
    runtime.activate({"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_REGISTRY": str(user_registry)})
    model, plain_model = _model(), _model()
    container = _container(model)
    installed = swap.installed(container.optimizers[0])
    assert installed is not None and len(installed.slices) == 3
    plain = torch.optim.AdamW(plain_model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1, fused=True)
    _train(model, container, 3)
    _train(plain_model, plain, 3)
    _assert_same_params(plain_model, model)
    record = runtime.current().report.patches["swap_optimizer"]
    assert record.state == "applied"
    assert any("AdamW states in host == device on the CPU rehearsal" in n and "3 slices" in n
               for n in record.notes), record.notes


def test_swap_is_off_by_default():
    runtime.activate({"TORCHTITAN_NPU": "cpu"})
    assert runtime.current().report.patches["swap_optimizer"].state == "disabled"
    assert swap.installed(_container(_model()).optimizers[0]) is None


def test_bad_slices_option_stops_at_activation_naming_file_and_option(tmp_path):
    user_registry = tmp_path / "registry.json"
    user_registry.write_text(json.dumps(
        {"schema": 1, "patches": {"swap_optimizer": {"default": True, "options": {"slices": 0}}}}
    ))
    with pytest.raises(ConfigError) as error:
        runtime.activate({"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_REGISTRY": str(user_registry)})
    assert str(error.value) == f"{user_registry}: patches['swap_optimizer']: option 'slices'=0 must be >= 1"
    assert runtime.current() is None


SIM_CHECK = """
    import json, torch, torch_npu
    from npu_inject.features import swap_optimizer as swap

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)]).to("npu")

    plain_model, swapped_model = model(), model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, fused=True)
    swapped = torch.optim.AdamW(swapped_model.parameters(), lr=1e-3, fused=True)
    swapper = swap.install(swapped, 4, torch.device("npu", 0), torch.npu)
    peaks = []
    for step in range(3):
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step)).to("npu")
        for m, o in ((plain_model, plain), (swapped_model, swapped)):
            o.zero_grad()
            m(x).sum().backward()
        base = torch.npu.memory_allocated()
        torch.npu.reset_peak_memory_stats()
        swapped.step()
        peaks.append(torch.npu.max_memory_allocated() - base)
        after = torch.npu.memory_allocated() - base
        plain.step()
    same = all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), swapped_model.parameters()))
    placement = sorted({(k, str(v.device), v.is_pinned()) for s in swapped.state.values() for k, v in s.items()})
    # Independent of the swap: per-parameter state bytes of the plain optimizer.
    state = {id(p): sum(v.numel() * v.element_size() for k, v in plain.state[p].items() if k != "step")
             for p in plain_model.parameters()}
    order = {id(p): id(q) for p, q in zip(swapped_model.parameters(), plain_model.parameters())}
    slices = [sum(state[order[id(p)]] for p in part) for part in swapper.slices]
    print(json.dumps({"same": same, "peaks": peaks, "after": after, "slices": slices,
                      "placement": placement}))
"""


def test_on_simulated_npu_states_are_pinned_and_device_memory_meets_the_goal(tmp_path):
    # The audit orders the side-stream copies and the updates by the events the swap records.
    env = sim_env(clean_env(TORCHTITAN_NPU_SIM_AUDIT="1", TORCHTITAN_NPU_SIM_AUDIT_DIR=str(tmp_path)))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SIM_CHECK)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"] is True
    assert result["placement"] == [["exp_avg", "cpu", True], ["exp_avg_sq", "cpu", True],
                                   ["step", "npu:0", False]]
    # Steps 2 and 3 stream existing state: at most 1/k of it plus the largest slice.
    slices = result["slices"]
    assert len(slices) == 4
    assert max(result["peaks"][1:]) <= sum(slices) / 4 + max(slices), result
    assert result["after"] <= 0, "nothing of the state stays on the device between steps"
    audit = json.loads((tmp_path / "audit_rank0.json").read_text())
    assert audit["stream_findings"] == [], audit["stream_findings"]
    assert len(audit["streams"]) >= 2, "the copies ran on a side stream"
