"""A torchrun stand-in for the test suite and tools/parallel_matrix.py: ranks are forked from a warm process.

Every end-to-end test launches ``torchrun -m torchtitan.train``. On a 2-core machine each rank
then spends 8-10 s importing what torchtitan imports (torch, dynamo, inductor, DTensor,
pipelining, datasets): all upstream, and the same in every run. This module keeps one server
process per session (a pytest run, a tool run) that has imported those modules -- never torchtitan, never
npu_inject's runtime, never torch_npu -- and forks the ranks from it. A rank then does what a
torchrun worker's interpreter does, in the same order:

1. takes the run's environment and torchrun's per-rank variables (RANK, LOCAL_RANK, WORLD_SIZE,
   MASTER_ADDR/PORT, OMP_NUM_THREADS=1 for more than one rank, ...);
2. puts the run's new PYTHONPATH entries on ``sys.path``;
3. executes the project's ``.pth`` line (the bootstrap that reads TORCHTITAN_NPU), then a
   ``sitecustomize`` found on those entries, in ``site``'s order;
4. runs ``torchtitan.train`` as ``__main__``.

So torchtitan, the runtime, torch_npu (real or simulated) and every patch are imported fresh
in each rank, after the bootstrap, exactly as under torchrun. What differs: torch and the other
upstream modules were imported before the run's environment was set. A run whose environment
differs from the server's in a variable those modules could read at import (TORCH*, HF_*,
OMP_*, ...) is therefore launched with the real torchrun, as is any run that asks for it
(``training_runs.torchrun(..., real=True)``, for tests about torchrun's own behaviour) and every run
when NPU_INJECT_TEST_LAUNCHER=torchrun. The bootstrap tests always use fresh interpreters.

Failure handling follows torchrun: when a rank fails, the others get SIGTERM, then SIGKILL
after 30 s; the launch exits 1 and prints which rank failed with which exit code or signal.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time

# What torchtitan.train imports that takes time (measured: 7.4 s of the 7.7 s import; the rest,
# torchtitan itself, is 0.3 s). Importing these has no side effect a run could observe.
PRELOAD = (
    "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor",
    "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.distributed.fsdp",
    "torch.distributed.elastic.multiprocessing.errors", "torch.nn.attention.flex_attention",
    "torch.distributed.tensor.experimental", "torch.utils.tensorboard", "datasets", "spmd_types",
    "tokenizers", "tyro", "torchdata", "wrapt", "packaging.specifiers",
)

# A variable with one of these prefixes may be read while the preloaded modules import; a run
# that sets it differently from the server gets the real torchrun.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "DATASETS", "TOKENIZERS", "OMP_", "MKL_",
                        "KMP_", "OPENBLAS", "LD_", "PYTHON", "TRITON", "CUDA", "NUMPY", "XDG_")
RUN_VARIABLES = ("PYTHONPATH",)  # handled per rank (step 2)
LAUNCHER_VAR = "NPU_INJECT_TEST_LAUNCHER"
KILL_GRACE_S = 30
PTH_NAME = "npu_inject_bootstrap.pth"


def import_time_differences(env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """The variables that keep a run off the warm launcher (empty: it may be forked)."""
    keys = set(env) | set(server_env)
    return sorted(key for key in keys
                  if env.get(key) != server_env.get(key) and key.startswith(IMPORT_TIME_PREFIXES)
                  and not key.startswith("TORCHTITAN_NPU") and key not in RUN_VARIABLES)


# -- client side (the pytest or tool process) --------------------------------------------------------

class Launcher:
    """One warm server per test session, started on first use."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.folder: str | None = None  # the server's socket lives here; removed with the server
        self.address: str | None = None
        self.server_env: dict[str, str] | None = None

    def start(self, server_env: dict[str, str]) -> None:
        self.folder = folder = tempfile.mkdtemp(prefix="npu_inject_forklaunch_")
        self.address = os.path.join(folder, "socket")
        self.server_env = dict(server_env)
        self.process = subprocess.Popen([sys.executable, __file__, "serve", self.address], env=self.server_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            rest = self.process.stdout.read()
            raise RuntimeError(f"tools/forklaunch.py: the server did not start: {ready}{rest}")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        if self.folder is not None:  # a session's socket folder was left in the temp folder, one per session
            shutil.rmtree(self.folder)
            self.folder = None

    def run(self, argv: list[str], env: dict[str, str], cwd: str, nproc: int, master_port: int,
            timeout: float) -> subprocess.CompletedProcess:
        """Like ``subprocess.run(torchrun ...)`` with stdout and stderr together in ``.stdout``."""
        with tempfile.NamedTemporaryFile("r", prefix="forklaunch_", suffix=".log") as log:
            request = {"argv": argv, "env": env, "cwd": cwd, "nproc": nproc, "master_port": master_port,
                       "log": log.name}
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(self.address)
                conn.sendall(json.dumps(request).encode() + b"\n")
                reader = conn.makefile("r")
                group = int(reader.readline())
                conn.settimeout(timeout)
                try:
                    line = reader.readline()
                except TimeoutError:
                    _kill_group(group)
                    raise subprocess.TimeoutExpired(["forklaunch", *argv], timeout, output=log.read()) from None
            returncode = int(line) if line.strip() else 1
            return subprocess.CompletedProcess(["forklaunch", *argv], returncode, stdout=log.read())


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- server side -----------------------------------------------------------------------------

def serve(address: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    server_path = list(sys.path)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        conn, _ = listener.accept()
        request = json.loads(conn.makefile("r").readline())
        if os.fork() == 0:
            listener.close()
            _launch(conn, request, server_path)  # never returns
        conn.close()
        while True:  # reap finished launches
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _launch(conn: socket.socket, request: dict, server_path: list[str]) -> None:
    """The forked launcher: a process group of its own, one forked child per rank, torchrun's
    exit rule. Reports its group id, then the exit code, on ``conn``."""
    os.setsid()
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    conn.sendall(f"{os.getpgid(0)}\n".encode())
    nproc = request["nproc"]
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(rank, request, server_path)
        ranks[pid] = rank
    failures = []
    deadline = None
    while ranks:
        if deadline is not None and time.monotonic() > deadline:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            deadline = None
        pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
        if pid == 0:
            time.sleep(0.2)
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures.append((rank, code))
            if deadline is None and len(failures) == 1:
                for other in ranks:
                    os.kill(other, signal.SIGTERM)
                deadline = time.monotonic() + KILL_GRACE_S
    for rank, code in failures:
        reason = f"Signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exitcode: {code}"
        print(f"forklaunch: rank {rank} failed: {reason}", flush=True)
    conn.sendall(f"{1 if failures else 0}\n".encode())
    os._exit(0)


def _run_rank(rank: int, request: dict, server_path: list[str]) -> None:
    """Become rank ``rank`` and run ``torchtitan.train`` as ``__main__``. Its SystemExit or
    uncaught exception propagates out of the server's frames to the interpreter, which then exits
    as ``python -m`` does: threads joined, atexit handlers run, the exit code or traceback."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    nproc = request["nproc"]
    env = dict(request["env"])
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
               WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
               GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["master_port"]),
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks per node
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count())))
    # `python -m` puts the working directory first; PYTHONPATH entries follow it.
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in server_path]
    sys.path[:] = [os.getcwd(), *added, *server_path[1:]]
    importlib.invalidate_caches()
    _run_bootstrap_line()
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in added):  # site runs it after .pth lines
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
    import runpy

    sys.argv = ["torchtitan.train", *request["argv"]]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _run_bootstrap_line() -> None:
    """Process the installed bootstrap ``.pth`` with ``site``'s own reader, as at interpreter start."""
    import site

    for folder in site.getsitepackages():
        if os.path.exists(os.path.join(folder, PTH_NAME)):
            site.addpackage(folder, PTH_NAME, set())
            return
    raise RuntimeError(f"tools/forklaunch.py: {PTH_NAME} is not in {site.getsitepackages()}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) != 3:
        raise SystemExit("usage: forklaunch.py serve SOCKET_PATH")
    serve(sys.argv[2])
