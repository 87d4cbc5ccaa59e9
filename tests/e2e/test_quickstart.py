"""The README's first command as a new user runs it: `bash tools/quickstart.sh` in a fresh copy of the repository
(the files git tracks, nothing beside them: no ../shared, no .venv) into a new virtual environment, with the plain
install (no extras: no torchft, no matplotlib), on this machine's target (the CPU rehearsal without torch_npu).

A quickstart that stopped at its doctor step (a patch for an optional package counted as a problem) or trained
nothing was invisible to the rest of the suite, which installs every extra into the developer's .venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from testkit import REPO, parse_losses

STEPS = 10


def tracked_copy(destination: str) -> None:
    """The working tree's tracked files at ``destination``: what a clone of a commit of this tree holds (an
    untracked file the code needs is missing here, as in a user's clone)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for relative in filter(None, listed.split("\0")):
        source = os.path.join(REPO, relative)
        if not os.path.lexists(source):  # deleted in the working tree, not yet committed
            continue
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def user_env() -> dict[str, str]:
    """A user's shell: none of the suite's variables, no virtual environment active, python3 on PATH."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
            "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_CONFIG_FILE", "NPU_INJECT_WHEEL_CACHE")
    env = {name: os.environ[name] for name in keep if name in os.environ}
    venv_bin = os.path.dirname(os.path.abspath(os.sys.executable))
    env["PATH"] = os.pathsep.join(part for part in env.get("PATH", "").split(os.pathsep) if part != venv_bin)
    return env


def test_the_quickstart_from_a_fresh_copy_trains(tmp_path):
    clone = tmp_path / "npu-inject"
    tracked_copy(str(clone))
    assert not (clone / ".venv").exists()
    result = subprocess.run(["bash", "tools/quickstart.sh"], cwd=clone, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "quickstart: torch_npu does not import here: running the CPU rehearsal" in result.stdout

    # the plain install: no extra came with it, and the patches for torchft say so instead of failing doctor
    python = clone / ".venv" / "bin" / "python"
    has = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('torchft') is None)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert has == "True", "the quickstart's plain install brought torchft"
    assert "torchft_commits    not applicable: torchft is not installed" in result.stdout
    assert "problem" not in result.stdout.split("patches enabled for target cpu:")[1].split("[rank0]")[0]

    log = (clone / "outputs" / "quickstart" / "train.log").read_text()
    losses = parse_losses(log)
    assert sorted(losses) == list(range(1, STEPS + 1)), log[-3000:]
    assert losses[STEPS] < losses[1]
    report = json.loads((clone / "outputs" / "quickstart" / "npu_inject" / "report_rank0.json").read_text())
    assert report["patches"]["torchft_heal"]["state"] == "not applicable"
    assert report["patches"]["host_memory_check"]["state"] == "applied"
    started = next(line for line in result.stdout.splitlines() if line.startswith("quickstart: training started"))
    print(f"{started}; losses {losses[1]:.5f} -> {losses[STEPS]:.5f}")
