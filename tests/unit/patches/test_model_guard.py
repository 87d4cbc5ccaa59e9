"""model_guard's decisions, on torchtitan's own config resolution and hand-made inputs."""

from __future__ import annotations

import os
import types

import pytest

from npu_inject import model_checks
from testkit import REPO, clean_env, run_python


@pytest.mark.parametrize("args,expected", [
    (["--module", "qwen3_5", "--config", "qwen35_debugmodel"], ("qwen3_5", "qwen35_debugmodel")),
    (["--module=torchtitan.models.flux", "--config=flux_debugmodel"], ("flux", "flux_debugmodel")),
    (["--module", "torchtitan.models.kimi_k2_7.config_registry", "--config", "x"], ("kimi_k2_7", "x")),
    (["--training.steps", "3"], (None, None)),
])
def test_selection_reads_both_cli_forms(args, expected):
    assert model_checks.selection(args) == expected


def test_unsupported_family_names_what_it_needs_and_trainable_ones_pass():
    problem = model_checks.family_problem("qwen3_5", "npu")
    assert "flash-linear-attention" in problem and "target npu" in problem
    assert model_checks.family_problem("llama3", "cpu") is None
    assert model_checks.family_problem(None, "cpu") is None


def test_missing_optional_package_names_the_distribution_and_how_to_install_it(monkeypatch):
    monkeypatch.setitem(model_checks.FAMILY_NEEDS, "llama3",
                        (model_checks.Needs("surely_not_installed_pkg", "not-installed", "testing"),))
    problem = model_checks.family_problem("llama3", "cpu")
    # a package none of npu-inject's extras pins is named as itself
    assert problem == "--module llama3 needs not-installed (testing), not installed: pip install not-installed"


def test_quantization_error_is_recognised_by_where_it_was_raised():
    from torchtitan.components.quantization import float8

    with pytest.raises((ImportError, ValueError)) as caught:  # no torchao, or no SM89 GPU
        float8.Float8LinearConverter(float8.Float8LinearConverter.Config())
    problem = model_checks.quantization_problem(caught.value, "llama3_debugmodel_float8", "npu")
    assert problem.startswith("--config llama3_debugmodel_float8 trains in float8"), problem
    assert model_checks.quantization_problem(ImportError("elsewhere"), "c", "npu") is None


def test_missing_local_data_is_named_with_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft = types.SimpleNamespace(dataloader=types.SimpleNamespace(
        load_dataset_kwargs={"data_files": "tests/assets/sft_test/data.json"}))
    problem = model_checks.data_problem(sft, "sft_debugmodel")
    assert os.path.join(str(tmp_path), "tests/assets/sft_test/data.json") in problem
    text = types.SimpleNamespace(dataloader=types.SimpleNamespace(dataset="c4_test"))
    assert "tools/make_assets.py" in model_checks.data_problem(text, "llama3_debugmodel")
    os.makedirs("tests/assets/c4_test")
    assert model_checks.data_problem(text, "llama3_debugmodel") is None
    image_text = types.SimpleNamespace(dataloader=types.SimpleNamespace(dataset="cc12m-test"))
    problem = model_checks.data_problem(image_text, "qwen35_debugmodel")
    assert os.path.join(str(tmp_path), "tests/assets/cc12m_test") in problem, problem
    assert "tools/make_mm_assets.py" in problem, problem
    os.makedirs("tests/assets/cc12m_test")
    assert model_checks.data_problem(image_text, "qwen35_debugmodel") is None


# A user's own corpus, outside this repository, run from a directory without tests/assets: the
# patched ConfigManager (TORCHTITAN_NPU=cpu, the .pth bootstrap) parses as torchtitan.train does.
PARSE_WITH_GUARD = """
import sys
from torchtitan.config import ConfigManager
for path in sys.argv[1:]:
    try:
        config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                             "--hf_assets_path", TOKENIZER, "--dataloader.dataset_path", path])
    except SystemExit as exc:
        print("STOP", exc)
    else:
        print("PASS", config.dataloader.dataset, config.dataloader.dataset_path)
"""


def test_dataset_path_outside_the_repository_is_what_the_guard_checks(tmp_path):
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    (corpus / "train.json").write_text('{"text": "hello"}\n')
    missing = tmp_path / "not_here"
    work = tmp_path / "cwd"  # no tests/assets here: torchtitan's default for c4_test does not exist
    work.mkdir()
    code = PARSE_WITH_GUARD.replace("sys.argv[1:]", repr([str(corpus), str(missing)]))
    code = code.replace("TOKENIZER", repr(os.path.join(REPO, "tests/assets/tokenizer")))
    result = run_python(code, env=clean_env(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1"), cwd=str(work))
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "STOP"))]
    assert result.returncode == 0 and len(lines) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert lines[0] == f"PASS c4_test {corpus}"
    assert lines[1] == (f"STOP npu_inject model_guard: --config llama3_debugmodel: --dataloader.dataset_path "
                        f"{missing} does not exist; torchtitan reads data set 'c4_test' from there with "
                        "datasets.load_dataset, which needs a directory (or a Hub id such as 'allenai/c4')")


def test_dataset_path_resolves_as_torchtitan_and_datasets_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def text(**loader):
        return types.SimpleNamespace(dataloader=types.SimpleNamespace(**loader))

    os.makedirs("data/sets/c4")  # relative to the working directory, as load_dataset reads it
    assert model_checks.data_problem(text(dataset="C4_TEST", dataset_path="data/sets/c4"), "c") is None
    problem = model_checks.data_problem(text(dataset="c4_test", dataset_path=""), "c")  # "" -> the default
    assert os.path.join(str(tmp_path), "tests/assets/c4_test") in problem and "--dataloader.dataset_path DIR" in problem
    problem = model_checks.data_problem(text(dataset="c4_test", dataset_path="data/sets/c5"), "c")
    assert f"--dataloader.dataset_path {tmp_path}/data/sets/c5 does not exist" in problem, problem
    open("data/corpus.json", "w").close()
    problem = model_checks.data_problem(text(dataset="c4", dataset_path=str(tmp_path / "data/corpus.json")), "c")
    assert f"--dataloader.dataset_path {tmp_path}/data/corpus.json is a file" in problem, problem
    # Hub ids and packaged builders (a relative path with at most one '/') are not local data.
    for path in ("allenai/c4", "json", "hf://datasets/allenai/c4"):
        assert model_checks.data_problem(text(dataset="c4_test", dataset_path=path), "c") is None, path
    assert model_checks.data_problem(text(dataset="c4"), "c") is None  # its default is on the Hub
    # Interleaved loaders read each source; an enabled validator reads its own loader.
    sources = [types.SimpleNamespace(dataset="c4_test", dataset_path="data/sets/c4"),
               types.SimpleNamespace(dataset="c4_test", dataset_path=str(tmp_path / "gone"))]
    problem = model_checks.data_problem(text(sources=sources), "c")
    assert f"--dataloader.sources[1].dataset_path {tmp_path}/gone does not exist" in problem, problem
    validator = types.SimpleNamespace(enable=True, dataloader=types.SimpleNamespace(dataset="c4_test"))
    config = types.SimpleNamespace(dataloader=types.SimpleNamespace(dataset="c4", dataset_path=None),
                                   validator=validator)
    assert "pass --validator.dataloader.dataset_path DIR" in model_checks.data_problem(config, "c")
    validator.enable = False
    assert model_checks.data_problem(config, "c") is None


def test_a_missing_tokenizer_folder_stops_at_parse_time_naming_the_flag(tmp_path):
    """torchtitan built the tokenizer after the model and failed in a 211-line traceback a minute later."""
    (tmp_path / "cwd").mkdir()  # no tests/assets here: the debug config's ./tests/assets/tokenizer does not exist
    empty = tmp_path / "empty"
    empty.mkdir()
    code = PARSE_WITH_GUARD.replace('"--hf_assets_path", TOKENIZER, ', '"--hf_assets_path", path, ')
    code = code.replace('"--dataloader.dataset_path", path]', f'"--dataloader.dataset_path", {str(tmp_path)!r}]')
    code = code.replace("sys.argv[1:]", repr(["/nonexistent", "tests/assets/tokenizer", str(empty),
                                              os.path.join(REPO, "tests/assets/tokenizer")]))
    result = run_python(code, env=clean_env(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1"), cwd=str(tmp_path / "cwd"))
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "STOP"))]
    assert result.returncode == 0 and len(lines) == 4, result.stdout[-3000:] + result.stderr[-3000:]
    stop = "STOP npu_inject model_guard: --config llama3_debugmodel builds its tokenizer from --hf_assets_path"
    download = ("put the model's Hugging Face tokenizer files there (torchtitan's scripts/download_hf_assets.py "
                "--repo_id ORG/MODEL --assets tokenizer, in its source repository), or pass --hf_assets_path DIR")
    assert lines[0] == f"{stop} /nonexistent, which does not exist: {download}"
    assert lines[1] == (f"{stop} {tmp_path}/cwd/tests/assets/tokenizer, which does not exist: python "
                        "tools/make_assets.py writes it (run from this repository, or pass --hf_assets_path DIR)")
    assert lines[2] == (f"{stop} {empty}, which holds none of the files torchtitan's tokenizer loads (tokenizer.json, "
                        f"vocab.json, vocab.txt): {download}")
    assert lines[3] == f"PASS c4_test {tmp_path}"


def test_only_a_tokenizer_that_reads_hf_assets_path_is_checked(tmp_path, monkeypatch):
    from dataclasses import dataclass

    from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer, MultiModalTokenizer

    @dataclass(kw_only=True, slots=True)
    class OwnPaths(BaseTokenizer.Config):  # as flux's FluxTokenizerContainer.Config (which needs transformers)
        t5_tokenizer_path: str = "google/t5-v1_1-small"

    monkeypatch.chdir(tmp_path)
    os.makedirs("tests/assets/c4_test")

    def config(tokenizer, path="tests/assets/tokenizer"):
        return types.SimpleNamespace(tokenizer=tokenizer, hf_assets_path=path,
                                     dataloader=types.SimpleNamespace(dataset="c4_test"))

    tokens = {name: f"<|{name}|>" for name in ("image_token", "video_token", "vision_start_token",
                                               "vision_end_token", "pad_token")}
    for reads_it in (HuggingFaceTokenizer.Config(), MultiModalTokenizer.Config(**tokens)):
        assert "which does not exist: python tools/make_assets.py writes it" in model_checks.data_problem(
            config(reads_it), "c"), reads_it
    # flux's tokenizers take their own paths; a config may build no tokenizer at all
    assert model_checks.data_problem(config(OwnPaths()), "flux_debugmodel") is None
    assert model_checks.data_problem(config(None), "c") is None
    os.makedirs("assets")
    open("assets/vocab.txt", "w").close()
    assert model_checks.data_problem(config(HuggingFaceTokenizer.Config(), "assets"), "c") is None
    problem = model_checks.data_problem(config(HuggingFaceTokenizer.Config(), "assets/vocab.txt"), "c")
    assert problem.endswith(f"--hf_assets_path {tmp_path}/assets/vocab.txt, which is a file, not a folder: put the "
                            "model's Hugging Face tokenizer files there (torchtitan's scripts/download_hf_assets.py "
                            "--repo_id ORG/MODEL --assets tokenizer, in its source repository), or pass "
                            "--hf_assets_path DIR"), problem


def test_cuda_only_optimizer_is_named_with_the_target():
    group = lambda name: types.SimpleNamespace(optimizer_name=name)  # noqa: E731
    muon = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[group("DistMuon"), group("AdamW")]))
    problem = model_checks.optimizer_problem(muon, "kimi_k2_5_debugmodel", "npu")
    assert problem.startswith("--config kimi_k2_5_debugmodel optimizes with DistMuon "
                              "(torchtitan.distributed.flex_shard)"), problem
    assert "target npu has no DistMuon" in problem, problem
    adamw = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[group("AdamW")]))
    assert model_checks.optimizer_problem(adamw, "llama3_debugmodel", "npu") is None
    assert model_checks.optimizer_problem(types.SimpleNamespace(), "c", "npu") is None


def _config(**sections):
    defaults = {"training": {"seq_len": 2048, "local_batch_size": 8, "global_batch_size": -1, "steps": 10},
                "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                                "context_parallel_degree": 1, "tensor_parallel_degree": 1,
                                "pipeline_parallel_degree": 1, "expert_parallel_degree": 1}}
    for section, values in sections.items():
        defaults[section].update(values)
    return types.SimpleNamespace(**{name: types.SimpleNamespace(**values) for name, values in defaults.items()})


@pytest.mark.parametrize("section,name,value,valid", [
    ("training", "seq_len", 0, ">= 1 (tokens per sample)"),
    ("training", "local_batch_size", 0, ">= 1 (samples per data-parallel rank and micro step)"),
    ("training", "global_batch_size", 0, ">= 1, or -1 for local_batch_size x the data-parallel degree (the default)"),
    ("training", "steps", -1, ">= 0 (optimizer steps to train)"),
    ("parallelism", "tensor_parallel_degree", 0, ">= 1"),
    ("parallelism", "data_parallel_shard_degree", -2,
     ">= 1, or -1 for the ranks the other degrees leave (the default)"),
])
def test_a_size_the_job_cannot_take_is_named_with_what_is_valid(section, name, value, valid):
    problem = model_checks.setting_problem(_config(**{section: {name: value}}))
    assert problem == f"--{section}.{name} {value} is not valid: it must be {valid}"


def test_sizes_the_job_can_take_pass():
    assert model_checks.setting_problem(_config()) is None
    assert model_checks.setting_problem(_config(training={"seq_len": 1, "local_batch_size": 1, "global_batch_size": 4,
                                                          "steps": 0})) is None
    assert model_checks.setting_problem(types.SimpleNamespace()) is None  # a config without the sections


def test_seq_len_0_stops_at_parse_time_in_one_line():
    """As torchtitan.train parses (the patched ConfigManager, TORCHTITAN_NPU=cpu): the stop comes before any
    data loader or patch code sees an empty sample (it was an IndexError in the first batch)."""
    code = PARSE_WITH_GUARD.replace('"--dataloader.dataset_path", path]', '"--training.seq_len", path]')
    code = code.replace("sys.argv[1:]", repr(["0", "16"])).replace("TOKENIZER", repr("tests/assets/tokenizer"))
    result = run_python(code, env=clean_env(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1"), cwd=REPO)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "STOP"))]
    assert result.returncode == 0 and len(lines) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert lines[0] == ("STOP npu_inject model_guard: --training.seq_len 0 is not valid: it must be >= 1 "
                        "(tokens per sample)")
    assert lines[1].startswith("PASS c4_test"), lines[1]
