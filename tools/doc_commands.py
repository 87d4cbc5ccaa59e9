"""The command blocks of README.md and docs/*.md, and what each one is.

Every block (indented by four spaces, or fenced with three backquotes) carries a classification: an HTML
comment on the line right before it (a blank line before the comment, none after; Markdown renders the block
as ever, and the comment not at all)::

    <!-- doc-block: KIND -->

KIND is one of

- ``run``: the docs suite (``tests/docs``, marker ``docs``) runs the block; it must exit 0 (see the directives).
- ``run TEST``: another test runs it: ``tests/<file>.py::<test name>``, or a file that holds the block's
  commands (``.ci/run`` holds ``bash tools/test.sh``).
- ``starts``: the docs suite checks that torchtitan's own argument parsing
  (``torchtitan.config.manager.ConfigManager().parse_args``) accepts the flags and config of each
  ``-m torchtitan.train`` command as written (placeholders filled in), then runs the block with the
  comment's substitutions (a job this machine holds, a short run); it must exit 0.
- ``output``: what a command printed; nothing is run.
- ``json``, ``json catalog``, ``json registry``, ``json hardware``: a JSON document, parsed; ``catalog``: an
  excerpt of ``npu_inject/registry.json`` (every value the packaged one), ``registry``: loaded as a user
  registry (``TORCHTITAN_NPU_REGISTRY``), ``hardware``: loaded as a ``--hardware-file``.
- ``illustrative: REASON``: not run, for the reason given (real NPUs, a cluster).

``run`` and ``starts`` take directives, one per line of the comment::

    <!-- doc-block: starts
      ASSETS_DIR = ./tests/assets/tokenizer
      --nproc_per_node 8 => --nproc_per_node 2
    -->

- ``A = B``: the placeholder A stands for B, in the parse check and in the run;
- ``A => B``: the run replaces A by B; ``{port}`` in B is a free port;
- ``before: COMMAND``: the run's shell runs COMMAND first (files the block reads);
- ``exit N if: TEXT``: the run may also exit N, when its output holds TEXT (a verdict that depends on the host);
- ``expect: TEXT`` (or ``expect K times: TEXT``): the run's output must hold TEXT (K times): what exit 0 alone does
  not say (``npu-inject suite`` exits 0 for a case that stopped at start-up as for a green one).

A line of the comment that starts with ``#`` is a remark for the reader (why a substitution is made).

A is replaced wherever it occurs as a whole (not inside a longer word: placeholder ``C`` leaves ``TORCHTITAN_NPU``
alone), and must occur in the block. In a ``run`` or ``starts`` block a line ``...`` alone ends the commands: what
follows is their output. No ``...`` may stand in a command itself (a flag the reader cannot see), unless a
directive replaces it.

The docs suite runs each block with bash (``-e -o pipefail``) in a copy of the repository's tracked files
(:func:`scratch_copy`), the repository's ``.venv/bin`` first on PATH, ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/ -> repo

PREFIX = "<!-- doc-block:"
KINDS = ("run", "starts", "output", "json", "illustrative")
JSON_SORTS = ("catalog", "registry", "hardware")
VALID_FORMS = """\
  <!-- doc-block: run -->                         the docs suite (tests/docs, -m docs) runs it
  <!-- doc-block: run tests/<file>.py::<test> --> another test runs it (or a file such as .ci/run holds it)
  <!-- doc-block: starts -->                      torchtitan parses its flags; it runs with the comment's substitutions
  <!-- doc-block: output -->                      output shown, nothing to run
  <!-- doc-block: json [catalog|registry|hardware] -->   a JSON document, parsed (and loaded)
  <!-- doc-block: illustrative: <the reason> -->  not run, for that reason
on the line right before the block; directives of run/starts one per line of the comment: 'A = B' (placeholder),
'A => B' (the run's substitution; {port}: a free port), 'before: COMMAND', 'exit N if: TEXT',
'expect [K times]: TEXT' (tools/doc_commands.py)"""
ELLIPSIS_LINE = "..."
# The one block CI runs (tests/docs marks its case e2e): the README's single-node command, on the rehearsal with a
# debug config for 2 steps. (document, the start of the block's text)
CI_BLOCK = ("README.md", "TORCHTITAN_NPU=1 torchrun --nproc_per_node 8 -m torchtitan.train")
# Scratch copies get these beside the tracked files: the virtual environments (links) and the built
# simulated NPU and CANN emulation (copies: their stamps name their sources' content, so nothing rebuilds).
LINKED = (".venv", ".venv-cann")
COPIED = (os.path.join("verification", "sim_npu", "build"), os.path.join("verification", "cann_emu", "build"))


@dataclass(frozen=True)
class Classification:
    kind: str
    reference: str | None = None  # run TEST
    detail: str | None = None  # json's sort, illustrative's reason
    placeholders: tuple[tuple[str, str], ...] = ()
    substitutions: tuple[tuple[str, str], ...] = ()
    before: tuple[str, ...] = ()
    exits: tuple[tuple[int, str], ...] = ()  # (status, text): exit status accepted when the output holds text
    expects: tuple[tuple[int, str], ...] = ()  # (times, text) the output must hold


@dataclass(frozen=True)
class Block:
    path: str  # relative to REPO
    line: int  # the block's first line (a fenced block's opening fence), 1-based
    text: str  # the block's lines, dedented (a fenced block's inner lines)
    fenced: bool
    classification: Classification | None = None
    error: str | None = None  # why the comment before it does not classify it
    comment_line: int | None = None
    adjacent: bool = True  # the comment ends on the line right before the block

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runs_here(self) -> bool:
        """Whether the docs suite runs it (run or starts, not run by another test)."""
        c = self.classification
        return c is not None and c.kind in ("run", "starts") and c.reference is None

    def commands(self) -> str:
        """The block's commands: its text up to a line ``...`` (the output shown after them)."""
        lines = self.text.splitlines()
        stripped = [line.strip() for line in lines]
        if ELLIPSIS_LINE in stripped:
            lines = lines[:stripped.index(ELLIPSIS_LINE)]
        return "\n".join(lines).strip("\n") + "\n"


def documents() -> list[str]:
    """README.md and docs/*.md, relative to the repository."""
    return ["README.md", *sorted(os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md")))]


LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+")
FENCE = re.compile(r"^(\s{0,3})(```+|~~~+)(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def raw_blocks(text: str) -> list[tuple[int, int, str, bool]]:
    """(first line, its indentation, dedented text, fenced) of each code block in a Markdown text: fenced blocks, and
    indented ones (four spaces past the content of the list item they are in, after a blank line or a comment)."""
    lines = text.splitlines()
    found = []
    content_indent = 0  # of the list item the text is in; 0 outside lists
    index = 0
    while index < len(lines):
        line = lines[index]
        fence = FENCE.match(line)
        if fence:
            closing = index + 1
            while closing < len(lines) and not lines[closing].strip().startswith(fence.group(2)):
                closing += 1
            inner = lines[index + 1:closing]
            cut = len(fence.group(1))
            found.append((index + 1, cut, "\n".join(part[cut:] if part[:cut].isspace() else part.lstrip()
                                                   for part in inner) + "\n", True))
            index = closing + 1
            continue
        if not line.strip():
            index += 1
            continue
        previous_blank = index == 0 or not lines[index - 1].strip()
        # an indented block cannot interrupt a paragraph: it follows a blank line, or an HTML comment's end
        after_comment = index > 0 and lines[index - 1].rstrip().endswith("-->")
        if (previous_blank or after_comment) and _indent(line) >= content_indent + 4:
            cut = content_indent + 4
            end = index
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) >= cut):
                end += 1
            while end > index and not lines[end - 1].strip():
                end -= 1
            found.append((index + 1, cut, "\n".join(part[cut:] for part in lines[index:end]) + "\n", False))
            index = end
            continue
        item = LIST_ITEM.match(line)
        if item:
            content_indent = len(item.group(0))
        elif previous_blank and _indent(line) < content_indent:
            content_indent = 0
        index += 1
    return found


def parse_classification(comment: str) -> Classification:
    """A ``<!-- doc-block: ... -->`` comment (one or several lines); raises ValueError saying what is wrong."""
    body = comment.strip()
    if not body.startswith(PREFIX) or not body.endswith("-->"):
        raise ValueError(f"not a {PREFIX} ... --> comment")
    lines = [line.strip() for line in body[len(PREFIX):-3].strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]  # '# ...': a remark for the reader
    if not lines:
        raise ValueError("no kind")
    head, directives = lines[0], lines[1:]
    kind, _, rest = head.partition(" ")
    if kind.startswith("illustrative"):
        reason = head[len("illustrative"):].lstrip()
        if not reason.startswith(":") or not (reason[1:].strip() or directives):
            raise ValueError("illustrative needs its reason: <!-- doc-block: illustrative: <the reason> -->")
        return Classification("illustrative", detail=" ".join([reason[1:].strip(), *directives]).strip())
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    rest = rest.strip()
    if kind == "output":
        if rest or directives:
            raise ValueError("output takes nothing more")
        return Classification("output")
    if kind == "json":
        if rest not in ("", *JSON_SORTS) or directives:
            raise ValueError(f"json takes one of {', '.join(JSON_SORTS)} or nothing, not {rest!r}")
        return Classification("json", detail=rest or None)
    if kind == "starts" and rest:
        raise ValueError("starts takes directives on the lines after it, nothing on its own line")
    placeholders, substitutions, before, exits, expects = [], [], [], [], []
    for directive in directives:
        exit_if = re.match(r"^exit (\d+) if: (.+)$", directive)
        expect = re.match(r"^expect(?: (\d+) times)?: (.+)$", directive)
        if expect:
            expects.append((int(expect.group(1) or 1), expect.group(2).strip()))
        elif exit_if:
            exits.append((int(exit_if.group(1)), exit_if.group(2).strip()))
        elif directive.startswith("before:"):
            before.append(directive[len("before:"):].strip())
        elif " => " in directive:
            old, new = directive.split(" => ", 1)
            substitutions.append((old.strip(), new.strip()))
        elif " = " in directive:
            old, new = directive.split(" = ", 1)
            placeholders.append((old.strip(), new.strip()))
        else:
            raise ValueError(f"directive {directive!r} is none of 'A = B', 'A => B', 'before: COMMAND', "
                             "'exit N if: TEXT', 'expect [K times]: TEXT'")
    if rest and (placeholders or substitutions or before or exits or expects):
        raise ValueError(f"run {rest} names the test that runs it: it takes no directives")
    return Classification(kind, reference=rest or None, placeholders=tuple(placeholders),
                          substitutions=tuple(substitutions), before=tuple(before), exits=tuple(exits),
                          expects=tuple(expects))


def _comment_before(lines: list[str], first: int) -> tuple[int | None, str | None, bool]:
    """(its first line number, its text, whether it ends right before the block) of the HTML comment that ends on
    the last non-blank line before line ``first`` (1-based); (None, None, _) when that line ends no comment."""
    index = first - 2
    while index >= 0 and not lines[index].strip():
        index -= 1
    adjacent = index == first - 2
    if index < 0 or not lines[index].strip().endswith("-->"):
        return None, None, adjacent
    end = index
    while index >= 0 and "<!--" not in lines[index]:
        index -= 1
    if index < 0:
        return None, None, adjacent
    return index + 1, "\n".join(line.strip() for line in lines[index:end + 1]), adjacent


def blocks_of(path: str, text: str) -> list[Block]:
    """The code blocks of the Markdown ``text`` (of ``path``) with their classifications."""
    lines = text.splitlines()
    found = []
    for line, _, block_text, fenced in raw_blocks(text):
        comment_line, comment, adjacent = _comment_before(lines, line)
        classification = error = None
        if comment is None or not comment.startswith(PREFIX):
            error = "no classification"
        else:
            try:
                classification = parse_classification(comment)
            except ValueError as exc:
                error = str(exc)
        found.append(Block(path, line, block_text, fenced, classification, error, comment_line, adjacent))
    return found


def blocks(path: str) -> list[Block]:
    """The code blocks of ``path`` (relative to the repository) with their classifications."""
    with open(os.path.join(REPO, path), encoding="utf-8") as handle:
        return blocks_of(path, handle.read())


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks(path)]


def is_ci_block(block: Block) -> bool:
    return block.path == CI_BLOCK[0] and block.text.startswith(CI_BLOCK[1])


# --- what the unit test checks ------------------------------------------------------------------------------


def _without_comments(command_text: str) -> str:
    """Command lines without their shell comments (a # that starts a word, outside quotes: good enough here)."""
    kept = []
    for line in command_text.splitlines():
        kept.append(re.split(r"(?:^|\s)#", line, maxsplit=1)[0])
    return "\n".join(kept)


def reference_problem(block: Block) -> str | None:
    """Why ``run TEST`` names no test that exists (or no file holding the block's commands); None when it does."""
    reference = block.classification.reference
    path, _, test = reference.partition("::")
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        return f"run {reference}: no file {path}"
    with open(full, encoding="utf-8") as handle:
        source = handle.read()
    if test:
        if not re.search(rf"^\s*(async\s+)?def {re.escape(test)}\(", source, re.M):
            return f"run {reference}: {path} defines no {test}"
        return None
    for line in _without_comments(block.commands()).splitlines():
        if line.strip() and line.strip() not in source:
            return f"run {reference}: {path} does not hold the block's line {line.strip()!r}"
    return None


def problems(block: Block) -> list[str]:
    """What is wrong with a block's classification, each naming file:line (empty when nothing is)."""
    where = block.where
    if block.classification is None:
        detail = "" if block.error == "no classification" else f" ({block.error})"
        return [f"{where}: a code block without a valid classification{detail}; put one of these on the line "
                f"before it:\n{VALID_FORMS}"]
    found = []
    c = block.classification
    if not block.adjacent:
        found.append(f"{where}: put the classification (line {block.comment_line}) on the line right before the "
                     "block, no blank line between")
    for old, _ in c.placeholders:
        if not occurs(block.commands(), old):
            found.append(f"{where}: the placeholder {old!r} does not occur in the block's commands")
    if c.kind in ("run", "starts") and not c.reference:
        filled = apply(block, run=False)
        for old, _ in c.substitutions:
            if not occurs(filled, old):
                found.append(f"{where}: the substitution's {old!r} does not occur in the block's commands "
                             "(placeholders filled in)")
    if c.kind == "run" and c.reference:
        problem = reference_problem(block)
        if problem:
            found.append(f"{where}: {problem}")
    if c.kind in ("run", "starts") and not c.reference:
        hidden = [line.strip() for line in _without_comments(apply(block, run=True)).splitlines()
                  if re.search(r"(^|\s)\.\.\.(\s|$)", line)]
        if hidden:
            found.append(f"{where}: '...' stands for flags the reader cannot see in {hidden[0]!r}: list them, or "
                         "name the substitution ('... => FLAGS')")
    if c.kind == "json":
        try:
            json.loads(block.text)
        except ValueError as exc:
            found.append(f"{where}: the json block does not parse: {exc}")
    return found


# --- running a block ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _pattern(old: str) -> re.Pattern:
    """``old`` as a whole: not part of a longer word (placeholder C must not rewrite the C of TORCHTITAN_NPU)."""
    before = r"(?<!\w)" if re.match(r"\w", old) else ""
    after = r"(?!\w)" if re.search(r"\w$", old) else ""
    return re.compile(before + re.escape(old) + after)


def occurs(text: str, old: str) -> bool:
    return _pattern(old).search(text) is not None


def replace(text: str, old: str, new: str) -> str:
    return _pattern(old).sub(lambda _: new, text)


def apply(block: Block, run: bool) -> str:
    """The block's commands with its placeholders filled in, and with ``run`` its substitutions made too."""
    text = block.commands()
    c = block.classification
    for old, new in c.placeholders:
        text = replace(text, old, new)
    if run:
        for old, new in c.substitutions:
            while "{port}" in new:
                new = new.replace("{port}", str(free_port()), 1)
            text = replace(text, old, new)
    return text


def script(block: Block) -> str:
    """What the docs suite gives bash: the ``before`` commands, then the block's with every substitution made."""
    return "".join(f"{command}\n" for command in block.classification.before) + apply(block, run=True)


SHELL_OPERATORS = re.compile(r"^[;&|<>()]+$")


def torchtitan_arguments(text: str) -> list[list[str]]:
    """The arguments after ``-m torchtitan.train`` of each command in ``text`` (continuations joined, comments,
    redirections and what follows a shell operator left out)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
        for index in range(len(tokens) - 1):
            if tokens[index] == "-m" and tokens[index + 1] == "torchtitan.train":
                arguments = []
                for token in tokens[index + 2:]:
                    if SHELL_OPERATORS.match(token):
                        if arguments and arguments[-1].isdigit() and token[0] in "<>":
                            arguments.pop()  # 2>&1
                        break
                    arguments.append(token)
                found.append(arguments)
    return found


PARSE = r"""
import contextlib, io, json, sys
from torchtitan.config.manager import ConfigManager
results = []
for arguments in json.load(sys.stdin):
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            ConfigManager().parse_args(arguments)
        results.append(None)
    except BaseException as exc:  # tyro exits (SystemExit) on a flag it does not know
        results.append(f"{type(exc).__name__}: {exc}\n{captured.getvalue()[-3000:]}")
print(json.dumps(results))
"""


def parse_with_torchtitan(argument_lists: list[list[str]], python: str = sys.executable,
                          env: dict[str, str] | None = None) -> list[str | None]:
    """For each argument list, None when torchtitan's ConfigManager accepts it, else its error (one process)."""
    if not argument_lists:
        return []
    base = {name: value for name, value in (env or os.environ).items() if not name.startswith("TORCHTITAN_NPU")}
    done = subprocess.run([python, "-c", PARSE], input=json.dumps(argument_lists), capture_output=True, text=True,
                          env=base, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the parse check itself failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [path for path in listed.split("\0") if path and os.path.lexists(os.path.join(REPO, path))]


def scratch_copy(destination: str) -> str:
    """A copy of the repository's tracked files at ``destination`` (as a clone of this tree), with links to its
    virtual environments and copies of the built simulated NPU and CANN emulation; returns ``destination``."""
    for relative in tracked_files():
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(REPO, relative), target, follow_symlinks=False)
    for relative in LINKED:
        if os.path.exists(os.path.join(REPO, relative)):
            os.symlink(os.path.join(REPO, relative), os.path.join(destination, relative))
    for relative in COPIED:
        if os.path.isdir(os.path.join(REPO, relative)):
            shutil.copytree(os.path.join(REPO, relative), os.path.join(destination, relative), symlinks=True)
    return destination


# Variables of the test run a reader's shell does not have.
NOT_A_READERS = ("PYTHONPATH", "VIRTUAL_ENV", "NPU_INJECT_TEST_LAUNCHER", "PYTEST_XDIST_WORKER",
                 "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST", "PYTEST_VERSION")


def reader_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A reader's shell: none of the runtime's variables, the repository's .venv/bin first on PATH,
    HF_HUB_OFFLINE=1, and torchrun's default master port a free one (PET_MASTER_PORT: other jobs on this host)."""
    env = {name: value for name, value in (base or os.environ).items()
           if not name.startswith("TORCHTITAN_NPU") and name not in NOT_A_READERS}
    env["PATH"] = os.pathsep.join([os.path.join(REPO, ".venv", "bin"), env.get("PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env["PET_MASTER_PORT"] = str(free_port())
    return env


def _end_session(session: int) -> None:
    """SIGKILL every process of the session the script's shell leads (its own process groups too: a ``timeout``
    makes one), read from /proc."""
    import signal

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # stat's 6th field (after pid and comm): the session id
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run(block: Block, folder: str, log: str, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs the block's script with bash in ``folder``, its output (both streams) into the file ``log``; returns
    (exit status, output; 124 past ``timeout``). Whatever the script left running (a background server) ends
    with it: the script runs in a session of its own, and every process of that session is ended after it."""
    with open(log, "w+", encoding="utf-8") as output:
        process = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script(block)], cwd=folder,
                                   env=env or reader_env(), stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = 124
        finally:
            _end_session(process.pid)
            process.wait()
        output.seek(0)
        return status, output.read()


def accepted(block: Block, status: int, output: str) -> bool:
    """Whether a run's exit status is what the block's classification expects (0, or an ``exit N if`` verdict)."""
    return status == 0 or any(status == code and text in output for code, text in block.classification.exits)


def missing_expected(block: Block, output: str) -> list[str]:
    """The ``expect`` directives the run's output does not meet, each as 'K x TEXT (found J)'."""
    return [f"{times} x {text!r} (found {output.count(text)})" for times, text in block.classification.expects
            if output.count(text) < times]


def main() -> int:
    """Lists every block with its classification; exit 1 when a block has a problem (the unit test's check)."""
    status = 0
    for block in all_blocks():
        c = block.classification
        label = "-" if c is None else c.kind + (f" {c.reference}" if c.reference else "") + (
            f" ({c.detail})" if c.detail else "")
        first = block.text.strip().splitlines()[0] if block.text.strip() else ""
        print(f"{block.where:28} {label[:60]:60} {first[:70]}")
        for problem in problems(block):
            print(f"  PROBLEM {problem.splitlines()[0]}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
