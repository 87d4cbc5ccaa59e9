"""A replica group's failure: the survivor's stall, the failed group's restart and heal, on each target.

torchtitan's torchft trainer (upstream's ``llama3_torchft_debugmodel``, a commit every step), torchft 0.2.0's
lighthouse, two replica groups of 2 ranks, each its own ``torchrun --max-restarts 1``; one rank of group 1 is
killed (or hung) at a chosen step by TORCHTITAN_NPU_FAULTS. Group 0 trains on alone; torchrun restarts
group 1, which heals from group 0's live state and rejoins. Both groups save their final state, so the two
can be compared tensor for tensor.

    python tools/bench_failover.py                 # kill (30 steps), then hang (60 steps): each run's stall
    python tools/bench_failover.py --fault kill@4:rank=1 --steps 30
    python tools/bench_failover.py --target sim     # the simulated NPU; cann: the real torch_npu on the emulation
    python tools/bench_failover.py --semi-sync local_sgd --target cann   # no fault: LocalSGD (or diloco) synchronising
    python tools/bench_failover.py --semi-sync diloco --fault kill@4:rank=1 --target cann   # the failover under DiLoCo

tests/e2e/test_torchft.py runs :func:`run_failover` and checks the outcome (kill, hang, kill under DiLoCo).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tools.training_runs import clean_env, free_port, parse_losses, without_host_memory_check  # noqa: E402

GROUP_SIZE = 2
PROCESS_GROUP_TIMEOUT_MS = 10000  # upstream's config; what bounds a hung peer's cost to the survivor
ARGS = ["--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--profiler.no-enable_profiling",
        "--metrics.log_freq", "1", "--debug.seed", "42", "--fault_tolerance.group_size", str(GROUP_SIZE),
        # a commit every step (HSDP across the groups), not upstream's DiLoCo
        "--fault_tolerance.semi_sync_method", "None",
        "--fault_tolerance.process_group_timeout_ms", str(PROCESS_GROUP_TIMEOUT_MS),
        # each group saves its full final state (upstream saves it from one group only) and nothing before
        # it: a restarted group can only get its weights from a live peer
        "--checkpoint.enable", "--checkpoint.interval", "100000", "--checkpoint.no-enable_ft_dataloader_checkpoints"]


def semi_sync_args(method: str | None, sync_steps: int = 2) -> tuple[str, ...]:
    """The arguments after :data:`ARGS` for LocalSGD or DiLoCo (``method``), a synchronisation every ``sync_steps``;
    none for ``None`` (a commit every step)."""
    if method is None:
        return ()
    return "--fault_tolerance.semi_sync_method", method, "--fault_tolerance.sync_steps", str(sync_steps)


STEP_LINE = re.compile(r"^\[default0\]:\[titan\] (\S+ \S+) - root - INFO - .*?step:\s*(\d+)\s", re.M)


@contextlib.contextmanager
def lighthouse(min_replicas: int = 1, join_timeout_ms: int = 1000):
    """torchft's lighthouse on a free port (a quorum of ``min_replicas`` groups or more, formed once every
    heartbeating group joined or ``join_timeout_ms`` after the first joined); yields its address.

    A group whose manager stopped heartbeating for 2 s is left out of the next quorum (torchft's default is 5 s):
    shorter than torchrun's restart of a killed group (4 s or more here), so the live group trains on alone
    before the restarted one rejoins, as on a cluster where a restart takes minutes. With 5 s, a restart that
    was quick enough joined the quorum the live group was waiting in, and nothing was trained alone."""
    port = free_port()
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    server = subprocess.Popen([str(binary), "--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_timeout_ms),
                               "--heartbeat_timeout_ms", "2000", "--bind", f"[::]:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"torchft_lighthouse did not answer on port {port} within 30 s") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


@dataclass
class Failover:
    logs: list[str]  # per group, both ranks' output (torchrun --tee, "[defaultN]:" prefixes)
    returncodes: list[int]
    dumps: list[Path]

    def step_times(self, group: int) -> dict[int, float]:
        """step -> wall time (s since the epoch) of rank 0's metric line, in the group's last attempt."""
        times = {}
        for stamp, step in STEP_LINE.findall(self.logs[group]):
            times[int(step)] = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return times

    def losses(self, group: int) -> dict[int, float]:
        """step -> loss of the group's rank 0 (its lines in the group's log)."""
        return parse_losses("\n".join(line.removeprefix("[default0]:") for line in self.logs[group].splitlines()
                                      if line.startswith("[default0]:")))

    def steps_logged(self, group: int) -> list[int]:
        return [int(step) for _, step in STEP_LINE.findall(self.logs[group])]

    def rejoined_at(self) -> int | None:
        """The step after the last break in group 1's steps: where it rejoined group 0's count (a restarted
        group may train a step or more on its own count before its first heal)."""
        logged = self.steps_logged(1)
        return next((b for a, b in reversed(list(zip(logged, logged[1:]))) if b != a + 1), None)

    def healed(self) -> bool:
        """Whether group 1's last attempt healed from a peer's live state (torchft_heal's note in its report)."""
        report = self.dumps[1] / "npu_inject" / "report_rank0.json"
        return "healed from a peer replica group's live state" in report.read_text(encoding="utf-8")

    def attempts(self, group: int) -> int:
        """How many times the group's rank 0 started (its runtime's one-line summary each time)."""
        return len(re.findall(r"^\[default0\]:.*npu_inject: target=", self.logs[group], re.M))

    def discarded(self, group: int) -> list[int]:
        """The steps rank 0 of the group discarded in the process (torchft_recover)."""
        return [int(step) for step in re.findall(r"^\[default0\]:.*npu_inject torchft_recover: step (\d+) discarded",
                                                 self.logs[group], re.M)]

    def failed(self, label: str, workdir: Path) -> bool:
        """Whether a group exited non-zero; then its logs stay in ``workdir``, named on one line."""
        if self.returncodes == [0, 0]:
            return False
        print(f"{label}: exit codes {self.returncodes}; both groups' logs are in {workdir}")
        return True


TARGETS = ("cpu", "sim", "cann")  # the CPU rehearsal, the simulated NPU, the real torch_npu on the CANN emulation


def target_environment(target: str, base: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(python, environment) of one replica group's torchrun on ``target``; ``base`` is clean_env's."""
    if target == "cpu":
        return sys.executable, without_host_memory_check({**base, "TORCHTITAN_NPU": "cpu"})
    if target == "sim":
        from verification.sim_npu import sim_env

        return sys.executable, sim_env({**base, "TORCHTITAN_NPU": "1"}, devices=GROUP_SIZE)
    if target == "cann":
        from verification.cann_emu import DEFAULT_VENV, cann_env

        python = Path(REPO) / os.environ.get("CANN_EMU_VENV", DEFAULT_VENV) / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"{python} is missing: run `bash verification/cann_emu/setup.sh` first")
        # CANN_EMU_HCCL_TIMEOUT (default 300 s): how long an emulated HCCL call waits for a peer that never answers
        return str(python), cann_env({**base, "TORCHTITAN_NPU": "1", "CANN_EMU_HCCL_TIMEOUT": "60"})
    raise ValueError(f"target {target!r}: one of {', '.join(TARGETS)}")


def run_failover(workdir: Path, steps: int = 30, fault: str | None = "kill@4:rank=1", timeout: int = 900,
                 target: str = "cpu", extra_args: tuple[str, ...] = (), min_replicas: int = 1,
                 extra_env: dict[str, str] | None = None, join_timeout_ms: int = 1000) -> Failover:
    """Two replica groups, the fault (if any) in group 1, each group under ``torchrun --max-restarts 1``;
    ``extra_args`` come after :data:`ARGS` (and override them), ``extra_env`` is added to both groups'.

    A hang runs under upstream's 15 s train timeout (what bounds it); any other run under 45 s, still inside
    torchft's 60 s quorum timeout: torchft_leave's watchdog ends a process whose step outlasts the train timeout,
    and on a loaded 2-core machine a step of the CANN emulation took 15 s (CI, 2026-11-28: both groups ended at
    step 2 of a run without a fault)."""
    train_timeout_s = 15 if fault and "hang" in fault else 45
    dumps = [workdir / f"group{group}" for group in range(2)]
    with lighthouse(min_replicas, join_timeout_ms) as address:
        processes = []
        for group, dump in enumerate(dumps):
            python, env = target_environment(target, clean_env(TORCHFT_LIGHTHOUSE=address, HF_HUB_OFFLINE="1"))
            env.update(extra_env or {})
            if group == 1 and fault:
                selection = [env.get("TORCHTITAN_NPU_PATCHES"), "+inject_faults"]
                env.update(TORCHTITAN_NPU_PATCHES=",".join(filter(None, selection)), TORCHTITAN_NPU_FAULTS=fault)
            command = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(GROUP_SIZE),
                       "--master_port", str(free_port()), "--max-restarts", "1", "--tee", "3",
                       "-m", "torchtitan.train", *ARGS, "--comm.train_timeout_seconds", str(train_timeout_s),
                       *extra_args, "--training.steps", str(steps),
                       "--fault_tolerance.replica_id", str(group), "--dump_folder", str(dump)]
            log = open(workdir / f"group{group}.log", "w+", encoding="utf-8")
            processes.append((subprocess.Popen(command, env=env, cwd=REPO, stdout=log,
                                               stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        returncodes = []
        for process, _ in processes:
            try:
                returncodes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other, _ in processes:
                    other.kill()
                raise
    logs = []
    for _, log in processes:
        log.seek(0)
        logs.append(log.read())
        log.close()
    return Failover(logs, returncodes, dumps)


def stall(run: Failover) -> tuple[float, float, int]:
    """(median step interval, longest interval, the step that ended it) of group 0, the survivor; an interval
    spans a step that logged nothing (discarded by torchft_recover)."""
    times = run.step_times(0)
    logged = sorted(times)
    intervals = {step: times[step] - times[before] for before, step in zip(logged, logged[1:])}
    longest = max(intervals, key=intervals.get)
    return statistics.median(intervals.values()), intervals[longest], longest


def model_tensors(state: dict[str, object]) -> dict[str, object]:
    """The model's own tensors of a torchtitan checkpoint's flat state (no optimizer, data, schedule or counters)."""
    import torch

    skip = ("optimizer.", "dataloader", "lr_scheduler", "train_state")
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor) and not key.startswith(skip)}


def final_parameters(checkpoint: Path) -> dict[str, object]:
    """The model's tensors of a DCP checkpoint, read by plain DCP (no runtime in this process)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(checkpoint, Path(scratch) / "plain.pt")
        return model_tensors(torch.load(Path(scratch) / "plain.pt", weights_only=False))


def semi_sync(method: str, target: str, steps: int) -> None:
    """LocalSGD or DiLoCo without a fault: commits, parameters equal across the groups, group 0's losses."""
    import torch

    workdir = Path(tempfile.mkdtemp(prefix="bench_failover_"))
    started = time.monotonic()
    run = run_failover(workdir, steps, fault=None, target=target, min_replicas=2, extra_args=semi_sync_args(method))
    took = time.monotonic() - started
    if run.failed(method, workdir):
        return
    commits = [log.count("should_commit=True enough_replicas=True") for log in run.logs]
    refused = [log.count("should_commit=False") for log in run.logs]
    group0, group1 = (final_parameters(dump / "checkpoint" / f"step-{steps}") for dump in run.dumps)
    shutil.rmtree(workdir)
    equal = sum(torch.equal(group0[key], group1[key]) for key in group0)
    losses = run.losses(0)
    print(f"{method}, {steps} steps, a synchronisation every 2, in {took:.0f} s: commits per group (both ranks) "
          f"{commits}, refused {refused}; after step {steps}, {equal} of {len(group0)} parameters equal across "
          f"the groups; group 0's losses {', '.join(f'{losses[step]:.5f}' for step in sorted(losses))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", action="append", help="TORCHTITAN_NPU_FAULTS for group 1 (repeatable; "
                        "default: kill@4:rank=1, then hang@4:rank=1)")
    parser.add_argument("--steps", type=int, help="default: 30 for kill, 60 for hang (a hung group comes back "
                        "after the 15 s train timeout, torchft_leave's watchdog and a restart: group 0 must still "
                        "be training)")
    parser.add_argument("--target", choices=TARGETS, default="cpu", help="cpu: the rehearsal (torchft on gloo); "
                        "sim: the simulated NPU, cann: the real torch_npu on the CANN emulation (both on torchft's "
                        "HCCL group)")
    parser.add_argument("--semi-sync", choices=["local_sgd", "diloco"], help="LocalSGD or DiLoCo (2 fragments, "
                        "upstream's), a synchronisation every 2 steps; without --fault: both groups from the start "
                        "to the end, 6 steps unless --steps; with it: the failover under that method")
    options = parser.parse_args()
    if options.semi_sync and not options.fault:
        semi_sync(options.semi_sync, options.target, options.steps or 6)
        return
    print(f"2 replica groups x {GROUP_SIZE} ranks, target {options.target}, "
          f"--fault_tolerance.process_group_timeout_ms {PROCESS_GROUP_TIMEOUT_MS}"
          + (f", {options.semi_sync} (a synchronisation every 2 steps)" if options.semi_sync
             else ", a commit every step"))
    for fault in options.fault or ["kill@4:rank=1", "hang@4:rank=1"]:
        steps = options.steps or (60 if fault.startswith("hang") else 30)
        workdir = Path(tempfile.mkdtemp(prefix="bench_failover_"))
        started = time.monotonic()
        run = run_failover(workdir, steps, fault, target=options.target, extra_args=semi_sync_args(options.semi_sync))
        took = time.monotonic() - started
        if run.failed(fault, workdir):
            continue
        median, longest, at = stall(run)
        resumed = run.rejoined_at()
        healed = run.healed()
        shutil.rmtree(workdir)
        rejoin = (f"group 1 healed and rejoined at step {resumed}" if healed and resumed else
                  f"group 1 did not heal (its restarted attempt began at step {resumed}: group 0 had finished)")
        survivor = f"group 0 started {run.attempts(0)} time(s)"
        if run.discarded(0):
            survivor += f", discarded step(s) {run.discarded(0)} in the process and trained on"
        print(f"{fault}: group 0 stalled {longest:.1f} s at step {at} (median step {median:.2f} s: "
              f"{longest - median:.1f} s lost); {survivor}; {rejoin}; {steps} steps in {took:.0f} s")


if __name__ == "__main__":
    main()
