"""torchtitan's fault tolerance (torchft) on the CPU rehearsal, upstream's own debug config (which names NCCL).

A lighthouse and one replica group of 2 ranks (torchft 0.2.0 from PyPI, DiLoCo as upstream configures it).
Upstream alone: torchft's NCCL group fails at every quorum and nothing is committed while the log looks like
training. Through the runtime: the group runs on gloo and every commit point commits; a group that can never
commit (min_replica_size above the replicas there are) stops on every rank with one line.

Failover (tools/bench_failover.py): two replica groups of 2 ranks committing every step; rank 1 of group 1 is
SIGKILLed at step 6 (``-m e2e_long``); the same under DiLoCo as upstream configures it (CI) and under LocalSGD
(``-m e2e_long``), killed at step 8. Group 0 never restarts and trains on; torchrun restarts group 1, which heals from group
0's live state (it has no checkpoint on disk) and rejoins; at the end both groups hold the same parameters,
optimizer state, schedule and step, tensor for tensor, and every step was applied once. The same failover on
the simulated NPU runs torchft's cross-group all-reduce on the runtime's HCCL group (patch torchft_npu;
``-m e2e_long``, outside CI); under DiLoCo and LocalSGD the healed group takes the live group's fragment
state too;
tests/cann_emu/test_torchft_failover.py runs both on the real torch_npu over the CANN emulation.

A hung rank (rank 1 of group 1 hangs at step 8): group 0 goes on after the train timeout (torchft_leave's
watchdog ends group 1's ranks) and the lighthouse's heartbeat timeout, and trains every step (``-m e2e_long``:
127 s of a CI worker's time on 2026-11-28; CI keeps the kill under DiLoCo above, and the hang's parts in
tests/cann_emu/test_hccl.py and the unit tests of torchft_leave; tests/cann_emu/test_torchft_failover.py runs
both hangs on the real torch_npu over the CANN emulation).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from test_checkpoint_resume import read_plain
from testkit import clean_env, parse_losses, torchrun
from tools.bench_failover import lighthouse as lighthouse_at, model_tensors, run_failover, semi_sync_args, stall

pytest.importorskip("torchft")

ARGS = ["--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable",
        "--profiler.no-enable_profiling", "--fault_tolerance.replica_id", "0", "--fault_tolerance.group_size", "1",
        "--fault_tolerance.sync_steps", "2"]


@pytest.fixture
def lighthouse():
    with lighthouse_at() as address:
        yield address


def test_upstream_torchft_config_commits_on_the_rehearsal(lighthouse, tmp_path):
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHFT_LIGHTHOUSE=lighthouse)
    result = torchrun([*ARGS, "--training.steps", "6", "--dump_folder", str(tmp_path)], env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert sorted(parse_losses(result.stdout)) == list(range(1, 7))
    committed = result.stdout.count("should_commit=True enough_replicas=True")
    assert committed >= 2 * 3 and "should_commit=False" not in result.stdout, result.stdout[-4000:]
    report = json.loads((tmp_path / "npu_inject" / "report_rank0.json").read_text())["patches"]["torchft_commits"]
    assert report["state"] == "applied"
    assert any(note.startswith("--fault_tolerance.process_group nccl runs on torchft's gloo group") for note in report["notes"])


def test_a_replica_group_that_never_commits_stops_with_one_line(lighthouse, tmp_path):
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHFT_LIGHTHOUSE=lighthouse)
    result = torchrun([*ARGS, "--fault_tolerance.min_replica_size", "2", "--training.steps", "20",
                       "--dump_folder", str(tmp_path)], env, timeout=600)
    assert result.returncode != 0
    stops = [line for line in result.stdout.splitlines() if line.startswith("npu_inject torchft_commits: ")]
    assert len(stops) == 2 and stops[0] == stops[1], result.stdout[-4000:]
    assert stops[0].startswith("npu_inject torchft_commits: torchft committed none of its first 5 commit points")
    assert max(parse_losses(result.stdout)) < 20


@pytest.mark.e2e_long  # about 3 min; CI runs the same kill under upstream's own mode, DiLoCo, below
def test_a_killed_replica_group_restarts_heals_from_the_live_group_and_ends_bitwise_equal(tmp_path):
    # enough steps that group 0 still trains when group 1 comes back on a loaded host: a group that returns after
    # its peers finished has no live state to heal from, and restart_progress rightly stops it
    check_failover(tmp_path, "cpu", steps=50, kill_at=6)


@pytest.mark.e2e_long  # 372 s on a slow host; CI runs torchft over HCCL on the real wheel (test_torchft_semi_sync)
def test_the_same_failover_on_the_simulated_npu_over_torchfts_hccl_group(tmp_path):
    check_failover(tmp_path, "sim", steps=30, kill_at=4)


def test_a_replica_group_killed_during_diloco_as_upstream_configures_it_heals_and_synchronises_again(tmp_path):
    # upstream's llama3_torchft_debugmodel: DiLoCo, 2 fragments, a synchronisation every 10 steps (a fragment
    # every 5): the restarted group trains alone until its first synchronisation, heals there (torchtitan's step
    # counter need not move: restart_progress reads torchft's own signal) and must take the live group's fragment
    # state as well, or the fragment synchronised at the last step would differ
    check_failover(tmp_path, "cpu", steps=60, kill_at=8, semi_sync="diloco", sync_steps=10)


@pytest.mark.e2e_long
def test_a_replica_group_killed_during_local_sgd_heals_and_synchronises_again(tmp_path):
    check_failover(tmp_path, "cpu", steps=60, kill_at=8, semi_sync="local_sgd", sync_steps=10)


@pytest.mark.e2e_long
def test_a_hung_rank_takes_its_group_out_of_the_quorum_within_the_train_timeout(tmp_path):
    check_hang(tmp_path, "cpu", steps=60)


def check_hang(tmp_path, target: str, steps: int) -> None:
    """Two replica groups of 2 ranks on ``target``; rank 1 of group 1 hangs as step 8 starts.

    Its rank 0 waits for it in a collective; after --comm.train_timeout_seconds (15 s in upstream's config)
    torchft_leave's watchdog ends both (each with its stack), and the lighthouse forms group 0's quorum alone 2 s
    later. Before, on the rehearsal, group 1's rank 0 failed at gloo's timeout and heartbeated 60 s more, and
    group 0's quorum timed out: both groups died."""
    # at step 8: a group 1 that started late heals to group 0's step at its first step, and the watchdog starts
    # after a process's first step (warm-up); it would have to be 7 steps late to hang there
    run = run_failover(tmp_path, steps, "hang@8:rank=1", target=target)
    survivor, hung = run.logs
    assert run.returncodes[0] == 0, survivor[-3000:]
    assert survivor.count("Training starts at step 1") == 2  # group 0 never restarted
    assert run.steps_logged(0) == list(range(1, steps + 1))
    hang = re.search(r"npu_inject inject_faults: step (\d+): hang on rank 1", hung)
    assert hang, hung[-3000:]
    assert hung.count("Timeout (0:00:15)!") == 2 and "in train_step" in hung, hung[-3000:]
    median, longest, at = stall(run)
    # the train timeout, then the lighthouse's 2 s
    assert at == int(hang.group(1)) and 15 < longest < 15 + 10, (longest, at, hang.group(0))
    # group 1 comes back once torchrun saw its ranks end: it heals if group 0 is still training, else it stops
    # with restart_progress's one line (nothing to heal from); either way it never trains alone from step 1
    healed = run.healed()
    stopped = "npu_inject restart_progress: restart attempt 1" in hung
    assert (run.returncodes[1] == 0 and healed) or stopped, hung[-3000:]
    print(f"{target} hang: group 0 stalled {longest:.1f} s at step {at} (median step {median:.2f} s); group 1 "
          f"{'healed and rejoined' if healed else 'stopped: group 0 had finished'}")


def check_synchronised(group0: dict, group1: dict, method: str) -> int:
    """What two replica groups hold after a LocalSGD or DiLoCo synchronisation at their last step (plain DCP
    entries of each group's checkpoint); returns how many parameters are equal across the groups.

    The groups read different data, so equal tensors mean the synchronisation ran. LocalSGD averages the whole
    model: every parameter equal. DiLoCo (streaming, 2 fragments) synchronises one fragment per step, in turn:
    that fragment (whole layers) equal, the other trained a step on each group's own data since. The inner
    optimizers stay each group's own: their Adam moments differ."""
    parameters = list(model_tensors(group0))
    moments = [key for key in group0 if key.startswith("optimizer.state.") and key.endswith("exp_avg")]
    assert len(parameters) > 50 and len(moments) > 20
    equal = [key for key in parameters if torch.equal(group0[key], group1[key])]
    assert not any(torch.equal(group0[key], group1[key]) for key in moments)  # inner optimizers stay local
    if method == "local_sgd":
        assert equal == parameters
    else:  # the fragment synchronised at the last step: a part of the model, whole layers
        assert 0 < len(equal) < len(parameters), (len(equal), len(parameters))
        layers = {key.split(".")[1] for key in equal if key.startswith("layers.")}
        assert layers and all(key in equal for key in parameters if key.startswith("layers.")
                              and key.split(".")[1] in layers)
    return len(equal)


def check_failover(tmp_path, target: str, steps: int, kill_at: int, semi_sync: str | None = None,
                   sync_steps: int = 2) -> None:
    """Two replica groups of 2 ranks on ``target``; rank 1 of group 1 killed as step ``kill_at`` starts.

    ``semi_sync``: LocalSGD or DiLoCo (``--fault_tolerance.semi_sync_method``), a synchronisation every
    ``sync_steps`` (DiLoCo's 2 fragments: one every half of that); else a commit every step. A semi-synchronous
    group meets its peers only at its synchronisations, so the lighthouse waits for the groups that heartbeat
    (torchft's default does, for 60 s): with the benchmark's 1 s, a restarted group formed its quorums alone and
    never healed."""
    run = run_failover(tmp_path, steps, f"kill@{kill_at}:rank=1", target=target,
                       extra_args=semi_sync_args(semi_sync, sync_steps),
                       join_timeout_ms=20000 if semi_sync else 1000)
    assert run.returncodes == [0, 0], run.logs[0][-3000:] + run.logs[1][-3000:]
    survivor, restarted = run.logs
    # at the step, or the first step after it group 1 trained (a group that starts late heals to group 0's step)
    killed = re.search(r"npu_inject inject_faults: step (\d+): kill on rank 1", restarted)
    assert killed and int(killed.group(1)) >= kill_at, restarted[-3000:]
    killed_at = int(killed.group(1))
    assert survivor.count("Training starts at step 1") == 2  # one attempt of 2 ranks: group 0 never restarted
    assert restarted.count("Training starts at step 1") == 4  # two attempts: nothing on disk to resume from

    # group 0 logged every step from its first to the last without a gap (a group that started late heals to
    # group 1's step at its first quorum and logs from there, before the kill)
    survived = run.steps_logged(0)
    assert survived == list(range(survived[0], steps + 1)) and survived[0] <= killed_at, survived
    logged = run.steps_logged(1)
    resumed = run.rejoined_at()
    assert resumed > killed_at + 1 and logged[logged.index(resumed):] == list(range(resumed, steps + 1)), logged
    # group 0 trained the steps between, while group 1 was down
    times = run.step_times(0)
    assert times[resumed - 1] - times[killed_at] > 0

    reports = [json.loads((dump / "npu_inject" / "report_rank0.json").read_text())["patches"] for dump in run.dumps]
    heal = reports[1]["torchft_heal"]
    assert any(note.startswith("healed from a peer replica group's live state") for note in heal["notes"]), heal
    if target != "cpu":  # upstream's nccl on the runtime's HCCL group: the cross-group all-reduce is HCCL's
        for report in reports:
            assert report["torchft_npu"]["state"] == "applied", report["torchft_npu"]
            assert any("runs on torchft's HCCL group" in note for note in report["torchft_npu"]["notes"])
    # both ranks commit every step, at every DiLoCo fragment's synchronisation, or at every LocalSGD one
    every = {None: 1, "diloco": sync_steps // 2, "local_sgd": sync_steps}[semi_sync]
    synchronised = [step for step in survived if step % every == 0]
    assert survivor.count("should_commit=True enough_replicas=True") >= 2 * len(synchronised)

    assert [sorted(p.name for p in (dump / "checkpoint").iterdir()) for dump in run.dumps] == [[f"step-{steps}"]] * 2
    group0, group1 = (
        {key: value for key, value in entries.items() if not key.startswith("dataloader")}
        for entries in read_plain(tmp_path, *(dump / "checkpoint" / f"step-{steps}" for dump in run.dumps)))
    assert sorted(group0) == sorted(group1)
    tensors = [key for key, value in group0.items() if isinstance(value, torch.Tensor)]
    assert any(key.startswith("optimizer.") for key in tensors) and len(tensors) > 100
    if semi_sync is None:
        # the groups read different data after the heal: equal tensors mean the cross-group all-reduce ran
        for key, value in group0.items():
            assert torch.equal(value, group1[key]) if key in tensors else value == group1[key], key
        end = "bitwise equal"
    else:
        end = f"{check_synchronised(group0, group1, semi_sync)} parameters equal"
    # every step applied once: Adam's count is torchtitan's one initialising step plus one per training step
    for group in (group0, group1):
        assert group["train_state.step"] == steps
        assert {group[key].item() for key in tensors if key.endswith(".step")} == {steps + 1}
    median, longest, at = stall(run)
    print(f"{target}{f' {semi_sync}' if semi_sync else ''}: group 0 stalled {longest:.1f} s at step {at} (median "
          f"step {median:.2f} s); group 1 rejoined at step {resumed}; {end}")
