"""The README stays short and every document it (or a doc) links to exists; the package has no symlinks."""

from __future__ import annotations

import ast
import os
import re

from testkit import REPO

LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _text(relative: str) -> str:
    with open(os.path.join(REPO, relative), encoding="utf-8") as handle:
        return handle.read()


def test_readme_is_short():
    # Generated blocks (the suite's capability matrix) are data, not prose: they do not count.
    text = re.sub(r"<!-- ([\w-]+):begin .*?<!-- \1:end -->", "", _text("README.md"), flags=re.S)
    assert len(text.splitlines()) <= 150, "README.md: move detail into docs/"


def test_every_linked_document_exists():
    sources = ["README.md", "CHANGELOG.md"] + [os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                                               if name.endswith(".md")]
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
