"""The command blocks of README.md and docs/*.md, run as a reader runs them (tools/doc_commands.py).

Each block classified ``run`` or ``starts`` (and not run by a test it names) is one case: the flags of each of its
``-m torchtitan.train`` commands must parse with torchtitan's own ConfigManager as written (placeholders filled in),
then the block runs with bash (``-e -o pipefail``) in a copy of the repository's tracked files, the repository's
.venv/bin first on PATH, HF_HUB_OFFLINE=1, with the substitutions its comment names (a job this machine holds, a
short run), and must exit 0 (or with the verdict an ``exit N if`` directive allows) and print what its ``expect``
directives name; a block that trains must log a loss. torchrun's default master port is a free one
(PET_MASTER_PORT), as other jobs share this host.

``bash tools/test.sh -m docs`` runs them all; CI runs one (``doc_commands.CI_BLOCK``, marked e2e). Blocks that read
torchtitan's source tree skip without TORCHTITAN_SRC, those on the CANN emulation without .venv-cann.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

from testkit import TORCHTITAN_SRC, parse_losses  # first: puts the repository root on sys.path for tools/
from tools import doc_commands
from tools.parallel_matrix import cann_missing

TIMEOUT_S = 1800

BLOCKS = [block for block in doc_commands.all_blocks() if block.runs_here]


def _marks(block: doc_commands.Block) -> list:
    marks = []
    if doc_commands.is_ci_block(block):
        marks.append(pytest.mark.e2e)
    if "torchft_lighthouse" in block.text:  # 4 ranks and a lighthouse: one torchft run at a time (tests/conftest.py)
        marks.append(pytest.mark.xdist_group("torchft_runs"))
    return marks


CASES = [pytest.param(block, id=block.where, marks=_marks(block)) for block in BLOCKS]


@pytest.fixture(scope="module")
def parse_errors(request):
    """where -> torchtitan's errors for its commands' flags, for the blocks this session runs (one process)."""
    selected = {item.callspec.params["block"].where: item.callspec.params["block"] for item in request.session.items
                if hasattr(item, "callspec") and isinstance(item.callspec.params.get("block"), doc_commands.Block)}
    commands = [(where, arguments) for where, block in selected.items()
                for arguments in doc_commands.torchtitan_arguments(doc_commands.apply(block, run=False))]
    results = doc_commands.parse_with_torchtitan([arguments for _, arguments in commands])
    errors: dict[str, list[str]] = {}
    for (where, arguments), error in zip(commands, results):
        if error:
            errors.setdefault(where, []).append(f"{' '.join(arguments)}\n{error}")
    return errors


def _skip_reason(script: str) -> str | None:
    if "$TORCHTITAN_SRC" in script and TORCHTITAN_SRC is None:
        return "needs torchtitan's release/0.3 source tree: set TORCHTITAN_SRC=<checkout>"
    if ".venv-cann" in script and cann_missing():
        return cann_missing()
    if "torchft" in script and importlib.util.find_spec("torchft") is None:
        return "needs torchft (pip install -c tools/pins.txt '.[torchft]')"
    return None


@pytest.mark.parametrize("block", CASES)
def test_the_block_runs_as_written(block, tmp_path, parse_errors):
    script = doc_commands.script(block)
    reason = _skip_reason(script)
    if reason:
        pytest.skip(reason)
    assert block.where not in parse_errors, (
        f"{block.where}: torchtitan does not parse these flags:\n" + "\n".join(parse_errors[block.where]))
    clone = doc_commands.scratch_copy(str(tmp_path / "clone"))
    started = time.monotonic()
    status, output = doc_commands.run(block, clone, str(tmp_path / "block.log"), timeout=TIMEOUT_S)
    took = time.monotonic() - started
    assert doc_commands.accepted(block, status, output), (
        f"{block.where} exited {status} after {took:.0f} s; its script:\n{script}\n--- its output's end:\n"
        f"{output[-8000:]}")
    missing = doc_commands.missing_expected(block, output)
    assert not missing, f"{block.where}: its output lacks {', '.join(missing)}:\n{output[-8000:]}"
    commands = doc_commands.apply(block, run=True)  # the block's own (a before command's output is its files)
    if doc_commands.torchtitan_arguments(commands):
        assert parse_losses(output), f"{block.where} trained no step:\n{output[-8000:]}"
    print(f"{block.where}: exit {status} in {took:.0f} s")
