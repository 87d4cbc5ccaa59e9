"""elastic_error_file: a rank killed while ``@record`` writes its error file leaves no half-written file for
torchrun's agent to choke on. The agent's side is torch's own ``ProcessFailure``, which reads the file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

# A rank whose @record-decorated function raises, and which is killed (the agent's SIGTERM, here SIGKILL so no
# handler runs) after torch has opened the error file and while json.dump writes into it.
RANK = textwrap.dedent("""
    import json, os, signal, sys
    from torch.distributed.elastic.multiprocessing.errors import record
    if sys.argv[1] == "patched":
        from npu_inject import module_facts
        from npu_inject.patching import PatchContext
        from npu_inject.patches import elastic_error_file
        elastic_error_file.apply(PatchContext("elastic_error_file", "cpu", {},
                                              declared_targets=module_facts.declared_names(elastic_error_file)))
    real_dump = json.dump
    def dump(data, handle, **kwargs):
        if sys.argv[2] == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_dump(data, handle, **kwargs)
    json.dump = dump

    @record
    def main():
        raise RuntimeError("Connection closed by peer")

    main()
""")


def _rank(tmp_path, mode: str, fate: str) -> tuple[subprocess.CompletedProcess, str]:
    error_file = str(tmp_path / f"{mode}_{fate}" / "error.json")
    (tmp_path / f"{mode}_{fate}").mkdir()
    env = {"TORCHELASTIC_ERROR_FILE": error_file, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", RANK, mode, fate], env=env, capture_output=True, text=True,
                          timeout=120)
    return done, error_file


def test_without_the_patch_a_rank_killed_mid_write_leaves_an_empty_file_the_agent_cannot_read(tmp_path):
    done, error_file = _rank(tmp_path, "upstream", "killed")
    assert done.returncode == -signal.SIGKILL
    with pytest.raises(json.JSONDecodeError):  # what took torchrun's agent down
        ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGKILL, error_file=error_file)


def test_a_rank_killed_mid_write_leaves_no_error_file_and_the_agent_reports_the_signal(tmp_path):
    done, error_file = _rank(tmp_path, "patched", "killed")
    assert done.returncode == -signal.SIGKILL
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGKILL, error_file=error_file)
    assert failure.signal_name() == "SIGKILL"


def test_a_rank_that_finishes_writing_leaves_torchs_own_record(tmp_path):
    done, error_file = _rank(tmp_path, "patched", "written")
    assert done.returncode == 1, done.stderr
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=error_file)
    assert failure.message["message"] == "RuntimeError: Connection closed by peer"
    assert [path.name for path in (tmp_path / "patched_written").iterdir()] == ["error.json"]  # no partial left
