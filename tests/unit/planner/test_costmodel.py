"""The cost model's collectives: how the link a group spans and the family's algorithms set their time."""

from types import SimpleNamespace

import pytest

from npu_inject import hardware
from npu_inject.planner import costmodel

GIB = 2**30
EFF = {"comm": 1.0}


def _op(collective: str, ranks: list[int]):
    return SimpleNamespace(collective=collective, group=tuple(ranks), comm_bytes=GIB)


def test_within_a_node_a_collective_takes_one_latency_and_the_links_bandwidth():
    a2 = hardware.load().find("A2")
    layout = costmodel.Layout(world_size=16, pp=1, scale_up_devices=8)
    seconds = costmodel.collective_seconds(_op("all_gather", list(range(8))), a2, EFF, layout)
    assert seconds == pytest.approx(7 / 8 * GIB / (a2.scale_up.bandwidth_gbps * 1e9) + a2.scale_up.latency_us * 1e-6)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_across_ascend_nodes_only_a_node_share_of_the_data_crosses_the_nics(collective):
    a2 = hardware.load().find("A2")
    layout = costmodel.Layout(world_size=16, pp=1, scale_up_devices=8)
    hierarchical = costmodel.collective_seconds(_op(collective, list(range(16))), a2, EFF, layout)
    passes = 2 if collective == "all_reduce" else 1
    # Every byte through each NIC (a ring over all 16 ranks) would take this long:
    ring = passes * 15 / 16 * GIB / (a2.scale_out.bandwidth_gbps * 1e9)
    crossing = passes * 1 / 2 * GIB / 8 / (a2.scale_out.bandwidth_gbps * 1e9)
    assert crossing < hierarchical < ring / 3


def test_across_nvidia_nodes_the_ring_is_bound_by_each_gpus_nic():
    h100 = hardware.load().find("H100")
    layout = costmodel.Layout(world_size=16, pp=1, scale_up_devices=8)
    seconds = costmodel.collective_seconds(_op("all_gather", list(range(16))), h100, EFF, layout)
    assert seconds >= 15 / 16 * GIB / (h100.scale_out.bandwidth_gbps * 1e9)


def test_this_host_as_a_device_is_measured():
    """``--hardware cpu`` (planning the CPU rehearsal): the host's matmul peak and copy bandwidth, measured."""
    profile = hardware.measure_host()
    assert profile.family == "cpu" and profile.peak("float32") > 0 and profile.memory_bandwidth_gbps > 0
    assert profile.memory_gib > 0


def _compute_op(index: int, nbytes: int):
    return SimpleNamespace(kind="compute", name="aten.add.Tensor", flops=0, bytes=nbytes, dtype="fp32", stream=0,
                           inputs=(index - 1,) if index else (), outputs=(index,), views=0, collective=None,
                           phase="forward", blocking=False, peer=None, group=(), module="", shape=())


@pytest.mark.parametrize("nbytes, host_bound", [(1_000, True), (10**9, False)])
def test_host_bound_when_issuing_takes_longer_than_the_devices_compute(nbytes, host_bound):
    """100 dependent operators issued at 20 us each: 4 us kernels leave the device waiting on the host
    (the step is the host's 2 ms); 1 GB ones (1 ms each at 1000 GB/s) keep it busy and the host ahead."""
    trace = SimpleNamespace(ops=[_compute_op(i, nbytes) for i in range(100)], marks=[])
    profile = SimpleNamespace(memory_bandwidth_gbps=1000.0, vector_tflops=100.0, peak=lambda dtype: 1e15, rates=None,
                              family="ascend")
    eff = {"kernel_us": 4.0, "memory": 1.0, "host_us": 20.0, "host_view_us": 1.0}
    layout = costmodel.Layout(world_size=1, pp=1, scale_up_devices=8)
    timing = costmodel.simulate({0: trace}, profile, eff, layout, {0: (0, 100)})
    assert timing.host_s == pytest.approx(100 * 20e-6)
    assert timing.host_bound is host_bound
    if host_bound:  # the device idles between launches: the step is the host's, the idle time is exposed
        assert timing.compute_s == pytest.approx(100 * 4e-6)
        assert timing.step_s == pytest.approx(100 * 20e-6 + 4e-6)
        assert timing.exposed_comm_s == pytest.approx(timing.step_s - timing.compute_s)
    else:
        assert timing.step_s == pytest.approx(20e-6 + 100 * 1e-3)


def test_a_host_read_makes_the_device_wait_for_the_host_to_issue_again():
    """100 dependent 1 ms operators issued at 20 us each keep the device busy and the host ahead; a read of a device
    value before operator 50 makes the host wait for operator 49's end and issue 50 only then: the device idles one
    issue (20 us), a term of its own; a read marked at the window's end is counted and costs nothing."""
    trace = SimpleNamespace(ops=[_compute_op(i, 10**9) for i in range(100)],
                            marks=[(50, "host_sync: a loss read"), (100, "host_sync: the logged loss")])
    profile = SimpleNamespace(memory_bandwidth_gbps=1000.0, vector_tflops=100.0, peak=lambda dtype: 1e15, rates=None,
                              family="ascend")
    eff = {"kernel_us": 4.0, "memory": 1.0, "host_us": 20.0, "host_view_us": 1.0}
    layout = costmodel.Layout(world_size=1, pp=1, scale_up_devices=8)
    reads = {50: ["a loss read"], 100: ["the logged loss"]}
    timing = costmodel.simulate({0: trace}, profile, eff, layout, {0: (0, 100)}, {0: reads})
    assert timing.step_s == pytest.approx(20e-6 + 100 * 1e-3 + 20e-6)
    assert timing.host_wait_s == pytest.approx(20e-6)
    assert timing.host_reads == {"a loss read": 1, "the logged loss": 1}
    assert timing.exposed_comm_s == pytest.approx(20e-6)  # the first issue, before the device has anything
    unread = costmodel.simulate({0: trace}, profile, eff, layout, {0: (0, 100)}, {0: {}})
    assert unread.step_s == pytest.approx(timing.step_s - 20e-6) and unread.host_wait_s == 0.0
    # Without ``reads``, the marks in [start, stop) are the window's.
    assert costmodel.simulate({0: trace}, profile, eff, layout, {0: (0, 100)}).host_reads == {"a loss read": 1}


def test_the_checks_cost_counts_the_windows_products_only_dense_and_grouped_apart():
    """One recorded step's window: a dense product of 2 x 4 x 3 bf16 elements costs its V-ABFT traffic (a, b twice,
    c, and 8 bytes per fp32 element of c) at the memory rate plus five launches; a grouped one five times its
    own bytes plus 60 launches; ops outside the window or outside forward and backward cost nothing."""
    profile = SimpleNamespace(memory_bandwidth_gbps=1.0)  # 1e9 bytes a second
    eff = {"memory": 1.0, "kernel_us": 10.0}
    dense = SimpleNamespace(name="aten.mm", phase="forward", shape=(2, 3, 4), bytes=2 * (8 + 12 + 6))
    grouped = SimpleNamespace(name="npu_inject.npu_grouped_matmul_backward", phase="backward", shape=(1, 1, 1),
                              bytes=1000)
    other = SimpleNamespace(name="aten.mm", phase="optimizer", shape=(2, 3, 4), bytes=52)
    trace = SimpleNamespace(ops=[dense, dense, grouped, other])
    cost = costmodel.matmul_check_cost({0: trace}, profile, eff, {0: (1, 4)})
    assert cost["dense"] == pytest.approx((2 * (8 + 2 * 12 + 6) + 8 * 6) / 1e9 + 5 * 10e-6)
    assert cost["grouped"] == pytest.approx(5 * 1000 / 1e9 + 2 * 60 * 10e-6)


def test_a_groups_mesh_dimensions_are_named_as_torchtitans_mesh_orders_them():
    """pp outermost, then dp_replicate, dp_shard, cp, tp: on 2 x 4 x 8 ranks (pp 2, cp 4, tp 8) a run of 8 is tp,
    a stride of 8 cp, both together "cp x tp"; without the degrees a group is unnamed."""
    layout = costmodel.Layout(world_size=64, pp=2, scale_up_devices=8, degrees={"pp": 2, "cp": 4, "tp": 8})
    assert layout.dimensions(tuple(range(8))) == "tp"
    assert layout.dimensions((3, 11, 19, 27)) == "cp"
    assert layout.dimensions(tuple(range(32, 64))) == "cp x tp"
    assert layout.dimensions((5, 37)) == "pp"
    assert costmodel.Layout(world_size=64, pp=2, scale_up_devices=8).dimensions((0, 1)) == ""


def _collective_op(index: int, collective: str, ranks, inputs, output: int, mesh: str = ""):
    return SimpleNamespace(kind="collective", name=f"c10d.{collective}", collective=collective, group=tuple(ranks),
                           mesh=mesh, comm_bytes=64 * 2**20, blocking=False, peer=None, stream=0, inputs=inputs,
                           outputs=(output,), views=0, flops=0, bytes=0, dtype="bf16", phase="forward", module="",
                           shape=())


def test_collectives_of_two_mesh_dimensions_over_the_same_ranks_are_named_by_their_meshes():
    """dp_shard 1 x cp 4: FSDP's all-gather (torchtitan's dp_shard_cp mesh) and the ring's (cp) span the same
    ranks; a group of no mesh is named by the dimensions its ranks differ in."""
    a2 = hardware.load().find("A2")
    layout = costmodel.Layout(world_size=32, pp=1, scale_up_devices=8, degrees={"cp": 4, "tp": 8})
    ops = [_collective_op(0, "all_gather", (0, 8, 16, 24), (), 100, mesh="dp_shard_cp"),
           _collective_op(1, "all_gather", (0, 8, 16, 24), (), 101, mesh="cp"),
           _collective_op(2, "all_gather", (0, 8, 16, 24), (), 102)]
    eff = {"kernel_us": 4.0, "memory": 1.0, "host_us": 20.0, "host_view_us": 1.0, "comm": 1.0}
    timing = costmodel.simulate({0: SimpleNamespace(ops=ops, marks=[])}, a2, eff, layout, {0: (0, len(ops))})
    one = costmodel.collective_seconds(ops[0], a2, costmodel.efficiency_with_rates(a2, eff), layout)
    assert timing.comm_by_group_s == pytest.approx({"dp_shard_cp all_gather": one, "cp all_gather": 2 * one})


def test_a_collective_issued_ahead_of_the_compute_it_overlaps_is_hidden_one_read_at_once_is_waited_on():
    """A ring's exchange (cp all_to_all, 1 ms across nodes) issued before a block of compute (100 GB of memory
    traffic, tens of ms) and read after it: the stream never
    waits on it. TP's all-gather read by the next operator: the stream waits its whole time. Both are busy."""
    a2 = hardware.load().find("A2")
    layout = costmodel.Layout(world_size=32, pp=1, scale_up_devices=8, degrees={"cp": 4, "tp": 8})
    block = SimpleNamespace(**{**vars(_compute_op(1, 10**11)), "inputs": (), "outputs": (1,)})
    ops = [_collective_op(0, "all_to_all", (0, 8, 16, 24), (), 100),
           block,
           SimpleNamespace(**{**vars(_compute_op(2, 10**3)), "inputs": (100, 1), "outputs": (2,)}),
           _collective_op(3, "all_gather", range(8), (2,), 101),
           SimpleNamespace(**{**vars(_compute_op(4, 10**3)), "inputs": (101,), "outputs": (4,)})]
    trace = SimpleNamespace(ops=ops, marks=[])
    eff = {"kernel_us": 4.0, "memory": 1.0, "host_us": 20.0, "host_view_us": 1.0, "comm": 1.0}
    timing = costmodel.simulate({0: trace}, a2, eff, layout, {0: (0, len(ops))})
    ring = costmodel.collective_seconds(ops[0], a2, costmodel.efficiency_with_rates(a2, eff), layout)
    gather = costmodel.collective_seconds(ops[3], a2, costmodel.efficiency_with_rates(a2, eff), layout)
    assert timing.comm_by_group_s == pytest.approx({"cp all_to_all": ring, "tp all_gather": gather})
    assert ring < timing.compute_s / 10  # far shorter than the block it hides behind
    assert timing.waited_by_group_s.get("cp all_to_all", 0.0) == 0.0
    assert timing.waited_by_group_s["tp all_gather"] == pytest.approx(gather)


def test_the_plan_names_each_groups_waits_beside_its_busy_time_and_leaves_out_pipeline_sends():
    from npu_inject.planner import render

    timing = costmodel.Timing(comm_by_group_s={"cp all_to_all": 9.4, "tp all_gather": 5.4, "pp send": 0.5,
                                               "cp all_reduce": 0.0001},
                              waited_by_group_s={"tp all_gather": 5.4, "cp all_to_all": 0.47})
    assert render.exposure_lines(timing) == [
        "  collectives by mesh dimension, the compute stream waiting on them (s): cp all_to_all 0.470 of 9.400 busy "
        "(95% hidden), tp all_gather 5.400 of 5.400 busy (0% hidden)"]
    assert render.exposure_lines(costmodel.Timing()) == []
