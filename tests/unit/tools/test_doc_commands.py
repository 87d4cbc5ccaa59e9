"""Every code block of README.md and docs/*.md is classified (tools/doc_commands.py): run by the docs suite
(tests/docs, ``-m docs``) or by a named test, checked to parse and start, shown output, a JSON document (parsed and
loaded here), or illustrative with its reason. A recipe whose ``...`` hid a flag it needed (docs/fault-tolerance.md's
torchft commands lacked --checkpoint.enable) is what this keeps from coming back."""

from __future__ import annotations

import json
import os
import re

import pytest

from testkit import REPO  # first: puts the repository root on sys.path for tools/
from tools import doc_commands


def test_every_block_of_the_readme_and_the_docs_is_classified():
    blocks = doc_commands.all_blocks()
    assert len(blocks) > 30 and {block.path for block in blocks} >= {"README.md", "docs/fault-tolerance.md"}
    found = [problem for block in blocks for problem in doc_commands.problems(block)]
    assert not found, "\n".join(found)


def test_ci_runs_exactly_one_block_of_the_docs_suite():
    ci = [block for block in doc_commands.all_blocks() if doc_commands.is_ci_block(block)]
    assert len(ci) == 1 and ci[0].runs_here, (doc_commands.CI_BLOCK, ci)


def _blocks(text: str) -> list[doc_commands.Block]:
    return doc_commands.blocks_of("docs/example.md", text)


def test_a_block_without_a_classification_fails_naming_its_line_and_the_valid_forms():
    text = "# T\n\nRun it:\n\n    npu-inject list\n\nand\n\n<!-- doc-block: output -->\n    shown\n"
    first, second = _blocks(text)
    (problem,) = doc_commands.problems(first)
    assert problem.startswith("docs/example.md:5: a code block without a valid classification")
    assert "<!-- doc-block: illustrative: <the reason> -->" in problem and "<!-- doc-block: starts -->" in problem
    assert doc_commands.problems(second) == []
    assert second.line == 10 and second.text == "shown\n"


@pytest.mark.parametrize("comment, error", [
    ("<!-- doc-block: runs -->", "unknown kind 'runs'"),
    ("<!-- doc-block: illustrative -->", "illustrative needs its reason"),
    ("<!-- doc-block: illustrative: -->", "illustrative needs its reason"),
    ("<!-- doc-block: json yaml -->", "json takes one of"),
    ("<!-- doc-block: output please -->", "output takes nothing more"),
    ("<!-- doc-block: starts\n  --steps 10 -->", "directive '--steps 10' is none of"),
    ("<!-- doc-block: run tests/x.py::t\n  A => B\n-->", "takes no directives"),
])
def test_a_malformed_classification_says_what_is_wrong(comment, error):
    (block,) = _blocks(f"Text\n\n{comment}\n    npu-inject list\n")
    (problem,) = doc_commands.problems(block)
    assert block.classification is None and error in problem, problem


def test_directives_are_read_one_per_line():
    (block,) = _blocks("x\n\n<!-- doc-block: starts\n  ASSETS_DIR = ./tests/assets/tokenizer\n"
                       "  --nproc_per_node 8 => --nproc_per_node 2 --master_port {port}\n  before: touch a\n"
                       "  exit 1 if: DOES NOT FIT\n  expect 2 times: step:\n  expect: FITS\n-->\n"
                       "    TORCHTITAN_NPU=1 torchrun --nproc_per_node 8 -m torchtitan.train \\\n"
                       "        --module llama3 --config llama3_8b --hf_assets_path ASSETS_DIR  # 8 NPUs\n")
    c = block.classification
    assert (c.kind, c.placeholders, c.before, c.exits) == (
        "starts", (("ASSETS_DIR", "./tests/assets/tokenizer"),), ("touch a",), ((1, "DOES NOT FIT"),))
    assert doc_commands.problems(block) == []
    assert doc_commands.torchtitan_arguments(doc_commands.apply(block, run=False)) == [
        ["--module", "llama3", "--config", "llama3_8b", "--hf_assets_path", "./tests/assets/tokenizer"]]
    script = doc_commands.script(block)
    assert script.startswith("touch a\nTORCHTITAN_NPU=1 torchrun --nproc_per_node 2 --master_port ")
    assert re.search(r"--master_port \d+ -m torchtitan.train", script)
    assert doc_commands.accepted(block, 1, "... DOES NOT FIT ...") and not doc_commands.accepted(block, 1, "FITS")
    assert c.expects == ((2, "step:"), (1, "FITS"))
    assert doc_commands.missing_expected(block, "step: 1 step: 2 FITS") == []
    assert doc_commands.missing_expected(block, "step: 1 FITS") == ["2 x 'step:' (found 1)"]


def test_placeholders_replace_whole_words_only():
    (block,) = _blocks("x\n\n<!-- doc-block: starts\n  M = llama3\n  C = llama3_debugmodel\n-->\n"
                       "    TORCHTITAN_NPU=cpu torchrun -m torchtitan.train --module M --config C\n")
    assert doc_commands.apply(block, run=False) == (
        "TORCHTITAN_NPU=cpu torchrun -m torchtitan.train --module llama3 --config llama3_debugmodel\n")


def test_a_substitution_or_placeholder_the_block_lacks_fails():
    (block,) = _blocks("x\n\n<!-- doc-block: starts\n  M = llama3\n  --steps 10 => --steps 2\n-->\n"
                       "    npu-inject plan --module llama3\n")
    placeholder, substitution = doc_commands.problems(block)
    assert placeholder.startswith("docs/example.md:7: the placeholder 'M' does not occur in the block's commands")
    assert substitution.startswith("docs/example.md:7: the substitution's '--steps 10' does not occur")


def test_a_hidden_ellipsis_in_a_command_fails_unless_a_substitution_names_it():
    hidden = "x\n\n<!-- doc-block: run -->\n    torchrun -m torchtitan.train --module llama3 ...\n"
    (problem,) = doc_commands.problems(_blocks(hidden)[0])
    assert problem.startswith("docs/example.md:4: '...' stands for flags the reader cannot see")
    named = hidden.replace("run -->", "starts\n  ... => --config llama3_debugmodel\n-->")
    assert doc_commands.problems(_blocks(named)[0]) == []
    # a line '...' alone ends the commands: their output follows; a '...' in a shell comment is prose
    shown = ("x\n\n<!-- doc-block: run -->\n    npu-inject plan --ngpu 4  # and so on ...\n    ...\n"
             "    FITS THIS HOST ...\n")
    (block,) = _blocks(shown)
    assert doc_commands.problems(block) == [] and block.commands() == "npu-inject plan --ngpu 4  # and so on ...\n"


def test_run_names_a_test_that_exists():
    def problem(reference: str, command: str = "bash tools/test.sh") -> list[str]:
        return doc_commands.problems(_blocks(f"x\n\n<!-- doc-block: run {reference} -->\n    {command}\n")[0])

    assert problem("tests/e2e/test_quickstart.py::test_the_quickstart_from_a_fresh_copy_trains") == []
    assert problem(".ci/run") == []
    assert "defines no test_nothing" in problem("tests/e2e/test_quickstart.py::test_nothing")[0]
    assert "no file tests/e2e/test_nowhere.py" in problem("tests/e2e/test_nowhere.py::test_x")[0]
    held = problem(".ci/run", "bash tools/quickstart.sh")
    assert "does not hold the block's line 'bash tools/quickstart.sh'" in held[0]


def test_blocks_in_list_items_and_fences_and_their_comments():
    text = ("- an item\n  continued\n\n  <!-- doc-block: run -->\n      python verification/sim_npu/build.py\n"
            "      eval x\n\n- another\n\n    a paragraph of the item, not code\n\nText\n\n"
            "<!-- doc-block: json registry -->\n```json\n{\"patches\": {}}\n```\n")
    item, fenced = _blocks(text)
    assert (item.line, item.text, item.classification.kind) == (5, "python verification/sim_npu/build.py\neval x\n",
                                                                 "run")
    assert (fenced.line, fenced.fenced, fenced.text, fenced.classification.detail) == (
        15, True, '{"patches": {}}\n', "registry")
    separated = _blocks("x\n\n<!-- doc-block: output -->\n\n    shown\n")[0]
    assert "on the line right before the block" in doc_commands.problems(separated)[0]


def test_torchtitan_arguments_stop_at_shell_operators():
    text = ("A=1 torchrun --standalone -m torchtitan.train --module torchft.llama3 --config c \\\n"
            "    --training.steps 2 &   # group 0\n"
            "torchrun -m torchtitan.train --module llama3 --config d 2>&1 | tee log\n"
            "npu-inject plan --module llama3\n")
    assert doc_commands.torchtitan_arguments(text) == [
        ["--module", "torchft.llama3", "--config", "c", "--training.steps", "2"],
        ["--module", "llama3", "--config", "d"]]


# --- the JSON documents, loaded as what they are ----------------------------------------------------------------

JSON_BLOCKS = [block for block in doc_commands.all_blocks()
               if block.classification is not None and block.classification.kind == "json"]


def test_the_docs_have_json_blocks_of_each_sort():
    assert {block.classification.detail for block in JSON_BLOCKS} >= {"catalog", "registry", "hardware"}


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=[block.where for block in JSON_BLOCKS])
def test_a_json_block_loads_as_what_it_is(block, tmp_path):
    document = json.loads(block.text)
    path = tmp_path / "document.json"
    path.write_text(block.text)
    sort = block.classification.detail
    if sort == "catalog":  # an excerpt of the packaged catalog: every value shown is the catalog's
        with open(os.path.join(REPO, "npu_inject", "registry.json"), encoding="utf-8") as handle:
            catalog = json.load(handle)

        def differences(shown, packaged, where):
            if isinstance(shown, dict) and isinstance(packaged, dict):
                return [difference for key, value in shown.items()
                        for difference in differences(value, packaged.get(key), f"{where}.{key}")]
            return [] if shown == packaged else [f"{where}: {shown!r} in the doc, {packaged!r} packaged"]

        assert not differences(document, catalog, "registry.json"), differences(document, catalog, "registry.json")
    elif sort == "registry":
        from npu_inject import registry

        merged = registry.load(str(path), entry_points=False)
        for patch_id, entry in document["patches"].items():
            for key, value in entry.items():
                assert getattr(merged.patches[patch_id], key) == value, (patch_id, key)
    elif sort == "hardware":
        from npu_inject import hardware

        catalog = hardware.load(str(path))
        for name in document.get("profiles", {}):
            assert name in catalog.profiles
        for alias, name in document.get("aliases", {}).items():
            assert catalog.aliases[alias] == name


# --- the docs suite's marker --------------------------------------------------------------------------------------


def test_the_docs_marker_is_registered_left_out_by_default_and_in_ci_but_its_e2e_case():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        options = tomllib.load(handle)["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("docs:") for marker in options["markers"])
    assert re.search(r"-m '[^']*\bor docs\b", options["addopts"]), options["addopts"]
    with open(os.path.join(REPO, "tools", "test.sh"), encoding="utf-8") as handle:
        assert "(e2e or not (parallel or docs))" in handle.read()
    with open(os.path.join(REPO, "docs", "development.md"), encoding="utf-8") as handle:
        assert "\n| `docs` |" in handle.read()
