"""The README stays short, no document names a folder of the machine it was written on, every
document and section it (or a doc) links to exists; the package has no symlinks."""

from __future__ import annotations

import ast
import os
import re

from testkit import REPO

LINK = re.compile(r"\]\(([^)#\s]+)\)")
# A work, scratch, temporary or home folder of some machine, or the checkout's neighbour folders.
MACHINE_PATH = re.compile(r"(?<![\w.$])(/(?:work|scratch|tmp|home|root|mnt|data|Users)/|~/|\.\./shared/)")


def _text(relative: str) -> str:
    with open(os.path.join(REPO, relative), encoding="utf-8") as handle:
        return handle.read()


def _documents() -> list[str]:
    """README, CHANGELOG, everything under docs/ (recorded suite data included), the verification READMEs."""
    found = ["README.md", "CHANGELOG.md"]
    for folder in ("docs", "verification"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            found += [os.path.relpath(os.path.join(root, name), REPO) for name in files
                      if name.endswith((".md", ".json")) and (folder == "docs" or name == "README.md")]
    return sorted(found)


def test_readme_is_short():
    # what a reader sees: HTML comments (the blocks' classifications, tools/doc_commands.py; generated blocks'
    # markers) are not shown
    shown = re.sub(r"<!--.*?-->\n?", "", _text("README.md"), flags=re.S)
    assert len(shown.splitlines()) <= 120, "README.md: move detail into docs/"


def test_no_document_names_a_folder_of_a_machine():
    found = [f"{path}:{number}: {line.strip()[:120]}" for path in _documents()
             for number, line in enumerate(_text(path).splitlines(), start=1) if MACHINE_PATH.search(line)]
    assert not found, found


def test_the_machine_path_check_can_fail():
    for line in ("--output /work/runs/x", "cd /tmp/x && ...", "cache in ~/.cache", "../shared/upstream/t"):
        assert MACHINE_PATH.search(line), line
    for line in ("$OUTPUT/artifacts", "docs/suite.md", "tests/sim/workers/", "a/tmp/b"):
        assert not MACHINE_PATH.search(line), line


# A folder beside the checkout, named in code: "../shared/", or os.path.join(<repo's parent>, "shared", ...).
NEIGHBOUR_FOLDER = re.compile(r"\.\./shared/|[\"']shared[\"'],\s*[\"']upstream")


def test_no_code_reaches_a_folder_beside_the_checkout():
    """A clone stands alone: torchtitan's source tree is an input (TORCHTITAN_SRC); .ci/run alone passes CI's copy."""
    found = []
    for folder in ("npu_inject", "tools", "tests", "verification"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                path = os.path.join(root, name)
                if name.endswith((".py", ".sh")) and path != os.path.abspath(__file__):
                    found += [f"{os.path.relpath(path, REPO)}:{number}" for number, line
                              in enumerate(open(path, encoding="utf-8").read().splitlines(), start=1)
                              if NEIGHBOUR_FOLDER.search(line)]
    assert not found, found
    assert NEIGHBOUR_FOLDER.search('os.path.join(os.path.dirname(REPO), "shared", "upstream")')


def test_every_linked_document_exists():
    sources = [path for path in _documents() if path.endswith(".md")]
    missing = []
    for source in sources:
        for target in LINK.findall(_text(source)):
            if "://" in target:
                continue
            if not os.path.exists(os.path.join(REPO, os.path.dirname(source), target)):
                missing.append(f"{source} -> {target}")
    assert not missing, missing


# A link to a document's section: [text](doc.md#anchor); a section named by its heading after a document:
# [text](doc.md), "Heading" or docs/doc.md, "Heading" (the heading starts with the quoted words).
ANCHOR = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")
NAMED_SECTION = re.compile(r'\]\(([^)#\s]+\.md)\),?\s+"([^"]+)"|(?<![\w/.(\[])([\w./-]+\.md),\s+"([^"]+)"')


def _headings(path: str) -> list[str]:
    in_code = False
    found = []
    for line in _text(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _resolve(source: str, target: str) -> str | None:
    for base in (os.path.dirname(source), ""):  # relative to the document, or a path from the repository root
        path = os.path.normpath(os.path.join(base, target))
        if os.path.isfile(os.path.join(REPO, path)):
            return path
    return None


def _section_references(source: str) -> list[tuple[str, str, str]]:
    """(target document, anchor or heading words, kind) for each reference to a section in ``source``."""
    text = _text(source)
    found = [(target or os.path.basename(source), anchor, "anchor") for target, anchor in ANCHOR.findall(text)]
    for match in NAMED_SECTION.finditer(text):
        found.append((match.group(1) or match.group(3), match.group(2) or match.group(4), "heading"))
    return found


def test_every_linked_section_exists():
    """No document points at a section that was renamed or removed."""
    missing = []
    for source in (path for path in _documents() if path.endswith(".md")):
        for target, name, kind in _section_references(source):
            path = _resolve(source, target)
            if path is None:
                missing.append(f"{source} -> {target} (no such document)")
                continue
            headings = _headings(path)
            if kind == "anchor" and name not in {_slug(heading) for heading in headings}:
                missing.append(f"{source} -> {target}#{name}")
            if kind == "heading" and not any(heading.replace("`", "").startswith(name.replace("`", ""))
                                             for heading in headings):
                missing.append(f'{source} -> {target}, "{name}"')
    assert not missing, missing


def test_the_section_check_can_fail():
    assert _slug("The CPU rehearsal on this host (`--hardware cpu`)") == "the-cpu-rehearsal-on-this-host---hardware-cpu"
    assert _slug("The rehearsal at upstream's shapes (no `--shrink`)") == "the-rehearsal-at-upstreams-shapes-no---shrink"
    text = 'see [planner.md](planner.md#hardware) and [suite.md](suite.md), "The matrix", or docs/x.md, "Y"'
    assert ANCHOR.findall(text) == [("planner.md", "hardware")]
    assert [(m.group(1) or m.group(3), m.group(2) or m.group(4)) for m in NAMED_SECTION.finditer(text)] == [
        ("suite.md", "The matrix"), ("docs/x.md", "Y")]


def test_the_package_holds_real_files_only():
    links = [os.path.join(root, name) for root, dirs, files in os.walk(os.path.join(REPO, "npu_inject"))
             for name in dirs + files if os.path.islink(os.path.join(root, name))]
    assert not links, links


def test_the_package_imports_no_verification_test_or_tool_code():
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "npu_inject")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), filename=path)
            for node in ast.walk(tree):
                modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{os.path.relpath(path, REPO)}:{node.lineno} imports {module}" for module in modules
                              if module.split(".")[0] in ("verification", "tests", "tools", "testkit")]
    assert not offenders, offenders
