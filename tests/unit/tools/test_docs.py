"""The README stays short, no document names a folder of the machine it was written on, every
document it (or a doc) links to exists; the package has no symlinks."""

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
    assert len(_text("README.md").splitlines()) <= 120, "README.md: move detail into docs/"


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
