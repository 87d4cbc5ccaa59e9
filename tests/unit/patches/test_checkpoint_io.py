"""checkpoint_staging and checkpoint_publish: staging on the target, atomic step folders, loading only
complete checkpoints.

The CheckpointManager here is torchtitan's own, in one process. Saves are interrupted by
making DCP's file writer raise (or the process SIGKILL itself) halfway through a data
file; what is checked afterwards is read with plain ``torch.distributed.checkpoint``
and file hashes, never with the patch's own helpers alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from npu_inject import runtime
from testkit import clean_env, sim_env

from testkit import REPO  # noqa: E402


def _activate():
    return runtime.activate({"TORCHTITAN_NPU": "cpu"})


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _manager(folder, model, async_mode="disabled", keep_latest_k=0):
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=20)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1,
                                      keep_latest_k=keep_latest_k, async_mode=async_mode)
    manager = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                           lr_schedulers=schedulers, states={}, sd_adapter=None, base_folder=str(folder))
    return manager, optimizers


def _train_step(model, optimizers, seed):
    optimizers.zero_grad()
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
    optimizers.step()


def _hashes(path):
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


class WriterFailure(RuntimeError):
    pass


def _fail_writing_after(monkeypatch, complete_items):
    """DCP's file writer writes ``complete_items`` items, then half of the next one, then raises."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item
    count = {"items": 0}

    def write_item(transforms, stream, data, write_item, storage_key, *args, **kwargs):
        if count["items"] >= complete_items:
            stream.write(b"\0" * 64)  # a torn write, then the crash
            raise WriterFailure("simulated crash in the middle of a checkpoint data file")
        count["items"] += 1
        return original(transforms, stream, data, write_item, storage_key, *args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)


def _torn_write():
    """DCP reports a writer's exception as a CheckpointException carrying its text."""
    from torch.distributed.checkpoint.api import CheckpointException

    return pytest.raises((WriterFailure, CheckpointException), match="simulated crash")


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo process group (async modes create a gloo subgroup)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _upstream_step_patterns() -> set[str]:
    """The step-folder regexes torchtitan's CheckpointManager scans with, read from its source."""
    import ast
    import inspect

    from torchtitan.components.checkpointer import dcp as titan_dcp

    tree = ast.parse(inspect.getsource(titan_dcp))
    patterns = {node.value for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and "step-" in node.value and "\\d" in node.value and not any(c.isspace() for c in node.value)}
    assert patterns, "torchtitan's checkpointer no longer names a step-N regex: re-check checkpoint_publish"
    return patterns


def test_staging_names_are_invisible_to_torchtitans_step_scan():
    import re

    from npu_inject.patches.checkpoint_publish import STEP_PATTERN, staging_path

    staged = staging_path("/ckpt/checkpoint/step-12")
    assert staged == "/ckpt/checkpoint/.saving-step_12"
    upstream = _upstream_step_patterns()
    assert STEP_PATTERN.pattern in upstream  # the patch scans with upstream's own pattern
    for pattern in upstream:  # applied as upstream applies them (re.search)
        assert re.search(pattern, os.path.basename(staged)) is None, pattern
        assert re.search(pattern, "step-12") is not None, pattern


def test_checkpoint_problem_names_what_is_missing(tmp_path):
    from npu_inject.patches.checkpoint_publish import checkpoint_problem

    path = str(tmp_path / "step-1")
    dcp.save({"a": torch.arange(1000.0), "b": torch.ones(3, 3)}, checkpoint_id=path)
    assert checkpoint_problem(path) is None
    data_file = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    with open(os.path.join(path, data_file), "r+b") as handle:
        handle.truncate(100)
    assert checkpoint_problem(path) == f"{data_file} holds 100 of its {_needed(path, data_file)} bytes"
    os.remove(os.path.join(path, data_file))
    assert checkpoint_problem(path) == f"{data_file} is missing"
    with open(os.path.join(path, ".metadata"), "wb") as handle:
        handle.write(b"not a pickle")
    assert checkpoint_problem(path).startswith(".metadata cannot be read")
    os.remove(os.path.join(path, ".metadata"))
    assert checkpoint_problem(path) == "no .metadata (the save did not finish)"


def _needed(path, data_file):
    metadata = dcp.FileSystemReader(path).read_metadata()
    return max(i.offset + i.length for i in metadata.storage_data.values() if i.relative_path == data_file)


def test_sync_save_publishes_step_folder_and_plain_dcp_reads_it(tmp_path):
    _activate()
    model = _model()
    manager, optimizers = _manager(tmp_path, model)
    _train_step(model, optimizers, 0)
    assert manager.save(curr_step=1)
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-1"]
    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(loaded, checkpoint_id=str(folder / "step-1"))
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key
    assert "checkpoints are written to .saving-<step> and renamed to step-N once complete" in \
        runtime.current().report.patches["checkpoint_publish"].notes
    manager.close()


def test_interrupted_save_keeps_the_last_good_checkpoint_and_resume_uses_it(tmp_path, monkeypatch):
    _activate()
    model = _model()
    manager, optimizers = _manager(tmp_path, model)
    _train_step(model, optimizers, 0)
    manager.save(curr_step=1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    step1_files = _hashes(tmp_path / "checkpoint" / "step-1")

    _train_step(model, optimizers, 1)
    _fail_writing_after(monkeypatch, complete_items=3)
    with _torn_write():
        manager.save(curr_step=2)
    monkeypatch.undo()
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == [".saving-step_2", "step-1"]
    assert _hashes(folder / "step-1") == step1_files
    manager.close()

    _activate()
    fresh = _model(seed=5)
    resumed, _ = _manager(tmp_path, fresh)
    assert resumed.load()  # newest complete: step-1
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, good[key]), key
    assert sorted(os.listdir(folder)) == ["step-1"]  # the torn save's leftovers were removed
    assert "removed .saving-step_2: leftover of a save that did not finish" in \
        runtime.current().report.patches["checkpoint_publish"].notes
    resumed.close()


def test_interrupted_resave_of_an_existing_step_leaves_it_intact(tmp_path, monkeypatch):
    """Upstream writes into step-N in place: a torn re-save damages the good checkpoint there."""
    def torn_resave(expect_damage):
        model = _model()
        manager, optimizers = _manager(tmp_path / ("up" if expect_damage else "patched"), model)
        _train_step(model, optimizers, 0)
        manager.save(curr_step=3)
        path = manager._create_checkpoint_id(3)
        before = _hashes(path)
        _train_step(model, optimizers, 1)
        _fail_writing_after(monkeypatch, complete_items=2)
        with _torn_write():
            manager.save(curr_step=3)
        monkeypatch.undo()
        manager.close()
        return before, _hashes(path), path

    before, after, _ = torn_resave(expect_damage=True)  # no runtime: upstream behavior
    assert before != after, "control: upstream really overwrote the good checkpoint"

    _activate()
    before, after, path = torn_resave(expect_damage=False)
    assert before == after
    from npu_inject.patches.checkpoint_publish import checkpoint_problem
    assert checkpoint_problem(path) is None


def test_completed_resave_replaces_the_step_atomically(tmp_path):
    _activate()
    model = _model()
    manager, optimizers = _manager(tmp_path, model)
    manager.save(curr_step=1)
    _train_step(model, optimizers, 0)
    manager.save(curr_step=1)
    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(loaded, checkpoint_id=manager._create_checkpoint_id(1))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-1"]
    notes = runtime.current().report.patches["checkpoint_publish"].notes
    assert any("exchanged atomically with an existing step-N" in n for n in notes), notes
    manager.close()


def test_incomplete_checkpoint_written_without_the_runtime_is_skipped(tmp_path):
    """step-2 looks valid to upstream (.metadata present) but lost a data file."""
    model = _model()
    manager, optimizers = _manager(tmp_path, model)  # runtime off: plain torchtitan writes
    manager.save(curr_step=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _train_step(model, optimizers, 0)
    manager.save(curr_step=2)
    manager.close()
    step2 = manager._create_checkpoint_id(2)
    data_file = next(n for n in os.listdir(step2) if n.endswith(".distcp"))
    os.remove(os.path.join(step2, data_file))
    assert manager._find_load_step() == 2  # upstream would pick the damaged one

    _activate()
    fresh = _model(seed=3)
    reader, _ = _manager(tmp_path, fresh)
    assert reader._find_load_step() == 1
    assert reader.load()
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    fallbacks = runtime.current().report.patches["checkpoint_publish"].fallbacks
    assert f"checkpoint step-2 skipped: incomplete ({data_file} is missing); trying an older one" in fallbacks
    with pytest.raises(FileNotFoundError, match=f"step-2 is incomplete: {data_file} is missing"):
        reader.load(step=2)
    reader.close()


def test_a_resume_that_finds_only_incomplete_checkpoints_stops_with_one_line(tmp_path):
    """Upstream logs "fresh start" and trains from step 1 over the folder; the runtime stops instead."""
    model = _model()
    manager, optimizers = _manager(tmp_path, model)  # runtime off: plain torchtitan writes
    manager.save(curr_step=2)
    _train_step(model, optimizers, 0)
    manager.save(curr_step=4)
    manager.close()
    step2, step4 = manager._create_checkpoint_id(2), manager._create_checkpoint_id(4)
    data_file = next(n for n in os.listdir(step4) if n.endswith(".distcp"))
    os.remove(os.path.join(step4, data_file))
    with open(os.path.join(step2, ".metadata"), "r+b") as handle:
        handle.truncate(10)
    os.makedirs(tmp_path / "checkpoint" / "step-6")  # a save that never wrote anything
    before = {name: _hashes(tmp_path / "checkpoint" / name) for name in ("step-2", "step-4", "step-6")}

    _activate()
    reader, _ = _manager(tmp_path, _model(seed=3))
    with pytest.raises(SystemExit) as stopped:
        reader.load()
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith(
        f"npu_inject checkpoint_publish: {tmp_path / 'checkpoint'} holds checkpoints but none is complete "
        f"(step-6: no .metadata (the save did not finish); step-4: {data_file} is missing; "
        "step-2: .metadata cannot be read ("), message
    assert message.endswith(
        "); resuming would start at step 1 and overwrite them. To start fresh on purpose, move that folder "
        "away, or pass another --checkpoint.folder or --dump_folder"), message
    assert {name: _hashes(tmp_path / "checkpoint" / name) for name in before} == before
    reader.close()


def test_an_empty_checkpoint_folder_is_a_fresh_start(tmp_path):
    _activate()
    (tmp_path / "checkpoint").mkdir()
    reader, _ = _manager(tmp_path, _model())
    assert reader.load() is False
    reader.close()


@pytest.mark.parametrize("async_mode", ["async", "async_with_pinned_mem"])
def test_async_save_publishes_on_completion_and_a_failed_upload_publishes_nothing(
        tmp_path, monkeypatch, single_rank_group, async_mode):
    _activate()
    model = _model()
    manager, optimizers = _manager(tmp_path, model, async_mode=async_mode)
    _train_step(model, optimizers, 0)
    manager.save(curr_step=1)
    manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-1"]
    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(loaded, checkpoint_id=str(folder / "step-1"))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())

    if async_mode == "async":  # the thread writer runs in this process, so the fault can be injected
        _fail_writing_after(monkeypatch, complete_items=1)
        _train_step(model, optimizers, 1)
        manager.save(curr_step=2)
        with _torn_write():
            manager.maybe_wait_for_saving()
        monkeypatch.undo()
        assert sorted(os.listdir(folder)) == [".saving-step_2", "step-1"]
    else:
        notes = runtime.current().report.patches["checkpoint_staging"].notes
        assert any(n.startswith("async_with_pinned_mem on cpu: staging copies into shared host memory")
                   for n in notes), notes
    manager.close()


def test_cpu_stager_copies_into_shared_memory():
    _activate()
    from torch.distributed.checkpoint.staging import StagingOptions
    from torchtitan.components.checkpointer import dcp as titan_dcp

    stager = titan_dcp.DefaultStager(StagingOptions(True, True, True, True))  # what torchtitan asks for
    source = {"w": torch.arange(12.0).reshape(3, 4), "nested": {"b": torch.ones(5)}}
    staged = stager.stage(source).result()
    assert torch.equal(staged["w"], source["w"]) and torch.equal(staged["nested"]["b"], source["nested"]["b"])
    assert staged["w"].is_shared() and staged["w"].data_ptr() != source["w"].data_ptr()
    stager.close()


KILL_MID_SAVE = """
    import os, signal, torch
    from npu_inject import runtime
    runtime.activate({"TORCHTITAN_NPU": "cpu"})
    import sys; sys.path[:0] = [%(tests)r, %(support)r]
    from test_checkpoint_io import _manager, _model, _train_step
    from torch.distributed.checkpoint import filesystem

    model = _model()
    manager, optimizers = _manager(%(folder)r, model)
    _train_step(model, optimizers, 0)
    manager.save(curr_step=1)
    torch.save(model.state_dict(), os.path.join(%(folder)r, "expected.pt"))
    original, calls = filesystem._write_item, []

    def write_item(transforms, stream, *args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            stream.write(b"torn")
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(transforms, stream, *args, **kwargs)

    filesystem._write_item = write_item
    _train_step(model, optimizers, 1)
    manager.save(curr_step=2)
    print("not reached")
"""


def test_killed_mid_save_resumes_from_the_last_good_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}
    code = textwrap.dedent(KILL_MID_SAVE % {"tests": os.path.dirname(os.path.abspath(__file__)),
                                       "support": os.path.join(REPO, "tests", "support"), "folder": str(tmp_path)})
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == [".saving-step_2", "step-1"]

    _activate()
    fresh = _model(seed=4)
    resumed, _ = _manager(tmp_path, fresh)
    assert resumed.load()
    expected = torch.load(tmp_path / "expected.pt")
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    resumed.close()


SIM_STAGING = """
    import json, torch
    from npu_inject import runtime
    runtime.activate({"TORCHTITAN_NPU": "1"})
    import torch_npu
    from torch.distributed.checkpoint.staging import StagingOptions
    from torchtitan.components.checkpointer import dcp as titan_dcp

    stager = titan_dcp.DefaultStager(StagingOptions(True, True, True, True))  # what torchtitan asks for
    source = {"w": torch.arange(4096.0, device="npu").reshape(64, 64), "b": torch.ones(7, device="npu")}
    before = torch.npu.host_memory_stats()["pinned_bytes.current"]
    staged = stager.stage(source).result()
    pinned = torch.npu.host_memory_stats()["pinned_bytes.current"] - before
    print(json.dumps({
        "equal": all(torch.equal(staged[k], v.cpu()) for k, v in source.items()),
        "device": sorted({str(t.device) for t in staged.values()}),
        "shared": all(t.is_shared() for t in staged.values()),
        "pinned_bytes": pinned,
        "notes": runtime.current().report.patches["checkpoint_staging"].notes,
    }))
    stager.close()
"""


def test_on_simulated_npu_staging_is_pinned_by_the_device_allocator():
    env = sim_env(clean_env())
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SIM_STAGING)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["equal"] and result["device"] == ["cpu"] and result["shared"]
    # Upstream pins only through CUDA; here the npu allocator holds both staging buffers.
    assert result["pinned_bytes"] >= 4096 * 4 + 7 * 4, result
    assert any("pinned host buffers from the npu allocator" in n for n in result["notes"])


def _saved_twice(tmp_path, monkeypatch=None, files_per_rank=1):
    """A runtime-written folder with step-1 and step-2 (a training step between them); with
    ``files_per_rank`` > 1 DCP's writer splits each checkpoint over that many data files, as
    several ranks would."""
    if files_per_rank > 1:
        from torch.distributed.checkpoint import FileSystemWriter

        plain_init = FileSystemWriter.__init__

        def init(self, path, *args, **kwargs):
            plain_init(self, path, *args, **{**kwargs, "thread_count": files_per_rank})

        monkeypatch.setattr(FileSystemWriter, "__init__", init)
    _activate()
    model = _model()
    manager, optimizers = _manager(tmp_path, model)
    manager.save(curr_step=1)
    _train_step(model, optimizers, 0)
    manager.save(curr_step=2)
    manager.close()
    return manager._create_checkpoint_id(1), manager._create_checkpoint_id(2)


def test_each_data_file_carries_the_size_and_crc32_of_the_bytes_written(tmp_path):
    import zlib

    step1, _ = _saved_twice(tmp_path)
    data_files = sorted(name for name in os.listdir(step1) if name.endswith(".distcp"))
    assert data_files
    for name in data_files:
        with open(os.path.join(step1, f".{name}.checksum.json"), encoding="utf-8") as handle:
            written = json.load(handle)
        data = open(os.path.join(step1, name), "rb").read()
        assert written == {"size": len(data), "crc32": zlib.crc32(data)}
    # plain DCP, no runtime, reads the folder as ever (it reads what .metadata names)
    loaded = {k: torch.empty_like(v) for k, v in _model(seed=5).state_dict().items()}
    runtime.deactivate()
    dcp.load(loaded, checkpoint_id=step1)
    assert all(torch.equal(v, _model().state_dict()[k]) for k, v in loaded.items())


@pytest.mark.parametrize("damage", ["overwritten in place", "truncated"])
def test_a_resume_refuses_a_damaged_checkpoint_naming_the_file_and_the_newest_intact_one(tmp_path, damage):
    step1, step2 = _saved_twice(tmp_path)
    data_file = sorted(name for name in os.listdir(step2) if name.endswith(".distcp"))[0]
    path = os.path.join(step2, data_file)
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        if damage == "truncated":
            handle.truncate(size // 2)
        else:
            handle.seek(size // 2)
            handle.write(b"\xff" * 16)
    assert os.path.getsize(path) == (size // 2 if damage == "truncated" else size)

    reader, _ = _manager(tmp_path, _model(seed=3))
    with pytest.raises(SystemExit) as stopped:
        reader.load()
    message = str(stopped.value)
    problem = (f"{data_file} holds {size // 2} bytes, {size} were written" if damage == "truncated"
               else f"{data_file} changed since it was written (CRC-32 ")
    assert message.startswith(f"npu_inject checkpoint_publish: checkpoint {step2} is damaged: {problem}"), message
    assert message.endswith("loading it would train on from garbage. The newest intact checkpoint is step-1: "
                            "resume from it with --checkpoint.load_step 1, or move step-2 away"), message
    with pytest.raises(SystemExit, match=f"checkpoint {step2} is damaged"):
        reader.load(step=2)
    assert reader.load(step=1)  # the intact one loads as ever
    reader.close()


def test_a_data_file_whose_checksum_was_deleted_is_refused_naming_the_missing_sum(tmp_path, monkeypatch):
    """Deleting one shard's sum must not switch checking off for that shard: it is overwritten in place here,
    and upstream (and the runtime before) loaded it without a word."""
    step1, step2 = _saved_twice(tmp_path, monkeypatch, files_per_rank=2)
    data_files = sorted(name for name in os.listdir(step2) if name.endswith(".distcp"))
    assert len(data_files) == 2, data_files
    os.remove(os.path.join(step2, f".{data_files[1]}.checksum.json"))
    with open(os.path.join(step2, data_files[1]), "r+b") as handle:
        handle.seek(os.path.getsize(handle.name) // 2)
        handle.write(b"\xff" * 16)

    reader, _ = _manager(tmp_path, _model(seed=3))
    with pytest.raises(SystemExit) as stopped:
        reader.load()
    message = str(stopped.value)
    assert "\n" not in message
    assert message == (
        f"npu_inject checkpoint_publish: checkpoint {step2} cannot be verified: checksum file "
        f".{data_files[1]}.checksum.json is missing (the checkpoint was written with checksums: {data_files[0]} "
        f"has its own), so {data_files[1]} cannot be checked. The fault is in the checksum file (the data may be "
        "intact), but loading unverified data could train on from garbage. The newest intact checkpoint is step-1: "
        "resume from it with --checkpoint.load_step 1, or move step-2 away"), message
    with pytest.raises(SystemExit, match=f"checksum file .{data_files[1]}.checksum.json is missing"):
        reader.load(step=2)
    reader.close()

    # With no sum left at all it reads as a checkpoint written without the runtime: it loads, said in the report.
    os.remove(os.path.join(step2, f".{data_files[0]}.checksum.json"))
    _activate()
    reader, _ = _manager(tmp_path, _model(seed=3))
    assert reader.load()
    assert ("checkpoint step-2 carries no checksums (written without the runtime): only its files' presence and "
            "sizes are checked") in runtime.current().report.patches["checkpoint_publish"].fallbacks
    reader.close()


@pytest.mark.parametrize("edit, fault", [
    ("{\"size\": 12, \"crc", "is not valid JSON (JSONDecodeError: "),
    ("{\"size\": 12}", "lacks an integer 'crc32' (it holds {\"size\": 12}; "),
    ("[1, 2]", "lacks an integer 'size' and 'crc32' (it holds [1, 2]; "),
])
def test_an_unreadable_checksum_file_is_named_as_the_fault_not_the_data(tmp_path, edit, fault):
    step1, step2 = _saved_twice(tmp_path)
    data_file = sorted(name for name in os.listdir(step2) if name.endswith(".distcp"))[0]
    sum_file = f".{data_file}.checksum.json"
    with open(os.path.join(step2, sum_file), "w", encoding="utf-8") as handle:
        handle.write(edit)

    reader, _ = _manager(tmp_path, _model(seed=3))
    with pytest.raises(SystemExit) as stopped:
        reader.load()
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith(f"npu_inject checkpoint_publish: checkpoint {step2} cannot be verified: checksum "
                              f"file {sum_file} {fault}"), message
    assert ('valid is {"size": <bytes>, "crc32": <CRC-32>}, both integers, as the runtime writes it). The fault is '
            "in the checksum file (the data may be intact)") in message
    assert message.endswith("The newest intact checkpoint is step-1: resume from it with --checkpoint.load_step 1, "
                            "or move step-2 away"), message
    assert f"{data_file} changed" not in message and "is damaged" not in message
    reader.close()
