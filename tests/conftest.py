"""Fixtures: a clean runtime per test, a fake target package, session-cached llama runs."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))  # testkit, kernelkit, gloo, sim_audit

from testkit import (  # noqa: E402
    NO_ACTIVATION_CHECKPOINTING,
    PLUGINS,
    clean_env,
    from_seed,
    reference_attention_env,
    sim_npu_env,
    train_llama,
    train_moe,
)

# tools/test.sh runs two pytest-xdist workers (--dist loadgroup): a 2-rank run leaves a quarter of
# two cores idle (ranks waiting on each other, start-up, torchtitan's 2 s end-of-run sleep). Tests
# that share session or module runs stay on one worker, so each run is still made once; the heaviest
# groups are queued first, the unit tests last (they fill the tail). The torchft runs (4 ranks and a lighthouse
# each, under a 15 or 45 s train timeout) go one at a time, on one worker: two at once put 8 busy ranks on two
# cores (load 8.5 in the fresh-clone run of 2026-11-28), where a slow step meets the watchdog.
SHARED_RUN_GROUPS = (("moe_rehearsal_runs", "moe_runs"), ("llama_runs", "llama_runs"))
# test file -> its group: a module's own runs, or one group for several files
MODULE_GROUPS = {name: name for name in (
    "test_parallel_matrix.py", "test_checkpoint_resume.py", "test_compare_runs.py", "test_train.py", "test_hccl.py",
    "test_cann_emu.py", "test_training_ops.py", "test_debug_outputs.py", "test_profiling.py",
    "test_cann_attention.py", "test_moe.py")} | {
    "test_torchft.py": "torchft_runs", "test_torchft_semi_sync.py": "torchft_runs"}
GROUP_ORDER = ("moe_runs", "torchft_runs", "llama_runs", "test_parallel_matrix.py", "test_checkpoint_resume.py",
               "test_compare_runs.py", "test_train.py", "test_hccl.py", "test_debug_outputs.py",
               "test_profiling.py")


def _run_group(item) -> str | None:
    fixtures = getattr(item, "fixturenames", ())
    for fixture, group in SHARED_RUN_GROUPS:
        if fixture in fixtures:
            return group
    return MODULE_GROUPS.get(item.path.name)


def _names_only_files_in_marked_folders(config) -> bool:
    """Whether the command line names paths, each a file or node id (not a folder) inside a folder whose
    conftest.py marks every test there (declares FOLDER_MARKER: tests/e2e, tests/cann_emu)."""
    folders = [os.path.dirname(os.path.abspath(plugin.__file__)) for plugin in config.pluginmanager.get_plugins()
               if hasattr(plugin, "FOLDER_MARKER") and getattr(plugin, "__file__", None)]
    paths = [os.path.abspath(os.path.join(config.invocation_params.dir, arg.split("::")[0])) for arg in config.args]
    return (config.args_source == pytest.Config.ArgsSource.ARGS and bool(paths)
            and all(os.path.isfile(path) and any(path.startswith(folder + os.sep) for folder in folders)
                    for path in paths))


def _addopts_mark_expression(config) -> str | None:
    """The -m of pyproject.toml's addopts (the default selection)."""
    expression, addopts = None, config.getini("addopts")
    for index, token in enumerate(addopts):
        if token == "-m" and index + 1 < len(addopts):
            expression = addopts[index + 1]
        elif token.startswith("-m") and token != "-m":
            expression = token[2:]
    return expression


def pytest_configure(config):
    # pyproject.toml's addopts leave the folder markers out (plain `pytest` runs the unit tests). A run
    # that names only files or node ids inside marked folders, with no -m of its own, runs them whole,
    # as a named file runs anywhere else (docs/development.md, Markers).
    if config.option.markexpr == _addopts_mark_expression(config) and _names_only_files_in_marked_folders(config):
        config.option.markexpr = ""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _run_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    position = {group: index for index, group in enumerate(GROUP_ORDER)}
    items.sort(key=lambda item: (position.get(_run_group(item), len(position)),
                                 "e2e" not in item.keywords))  # stable: collection order within


def _runtime_variables() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("TORCHTITAN_NPU")}


@pytest.fixture(autouse=True)
def _clean_runtime(request):
    """Every test starts and ends with no active runtime (patches reverted), and leaves the runtime's
    variables in os.environ as it found them: a TORCHTITAN_NPU left behind switches the runtime on in every
    process the worker starts later (it once broke a simulator suite in CI, two files away)."""
    from npu_inject import runtime

    runtime.deactivate()
    before = _runtime_variables()
    yield
    runtime.deactivate()
    after = _runtime_variables()
    if after != before:
        for name in after:
            os.environ.pop(name)
        os.environ.update(before)
        changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
        pytest.fail(f"{request.node.nodeid} changed {', '.join(changed)} in os.environ and left it so (restored now); "
                    "use monkeypatch.setenv or pass env= to the child")


@pytest.fixture
def fake_target(tmp_path, monkeypatch):
    """A throwaway package 'faketitan' plus a registry whose patches live in tests/support/plugins.

    Returns a function writing the registry (dict of patch id -> entry) and giving its path.
    """
    package = tmp_path / "faketitan"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text(textwrap.dedent('''
        DEVICE = "cuda"

        def compute(x):
            return x + 1

        class Engine:
            def run(self, x):
                return x * 2

            @staticmethod
            def build():
                return "built"

            @classmethod
            def create(cls):
                return cls

            @property
            def name(self):
                return "engine"
    '''))
    (package / "other.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(PLUGINS)
    for name in list(sys.modules):
        if name.startswith(("faketitan", "fake_patch_")):
            monkeypatch.delitem(sys.modules, name)

    def write_registry(patches: dict) -> str:
        path = tmp_path / "registry.json"
        path.write_text(json.dumps({"schema": 1, "patches": patches}))
        return str(path)

    return write_registry


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> str:
    """One rank writes step-0 weights: every parity run starts from the same parameters, whatever
    its device and sharding (random init differs across device types and shardings)."""
    dump = str(tmp_path_factory.mktemp("seed"))
    train_llama("llama3_debugmodel", dump, clean_env(TORCHTITAN_NPU="cpu"), steps=1, nproc=1, extra=[
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1"])
    return os.path.join(dump, "checkpoint", "step-0")


@pytest.fixture(scope="session")
def llama_runs(tmp_path_factory, seed_checkpoint):
    """Each (config, variant) trains once per session from the seed checkpoint: 'cpu' (rehearsal),
    'reference' (rehearsal with the independent SDPA attention), 'sim' (2 simulated NPUs, device audit on)."""
    cache = {}

    def get(config: str, variant: str):
        if (config, variant) not in cache:
            dump = str(tmp_path_factory.mktemp(f"{config}_{variant}"))
            env = {
                "cpu": lambda: clean_env(TORCHTITAN_NPU="cpu"),
                "reference": reference_attention_env,
                "sim": lambda: sim_npu_env(
                    TORCHTITAN_NPU_REGISTRY=os.path.join(PLUGINS, "device_audit_registry.json"),
                    TORCHTITAN_NPU_SIM_AUDIT="1"),
            }[variant]()
            losses, log = train_llama(config, dump, env, extra=from_seed(seed_checkpoint))
            cache[config, variant] = losses, log, dump
        return cache[config, variant]

    return get


@pytest.fixture(scope="session")
def moe_rehearsal_runs(tmp_path_factory):
    """Each eager MoE rehearsal run (module, config, extra arguments, steps; runtime defaults,
    activation checkpointing off) trains once per session: tests/e2e/test_moe_train.py's patched
    deepseek_v3 and qwen3 MoE EP 2 runs are also tests/e2e/test_compile_train.py's eager baselines. Returns
    (step -> loss, dump folder)."""
    cache = {}

    def get(module: str, config: str, extra=(), steps: int = 10):
        key = module, config, tuple(extra), steps
        if key not in cache:
            dump = str(tmp_path_factory.mktemp(f"{config}_rehearsal"))
            losses = train_moe(module, config, dump, clean_env(TORCHTITAN_NPU="cpu"), steps=steps, extra=extra,
                               tail=NO_ACTIVATION_CHECKPOINTING, timeout=1200)
            cache[key] = losses, dump
        return cache[key]

    return get
