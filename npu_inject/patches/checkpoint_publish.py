"""A checkpoint is published whole (step-N by one atomic rename) or not at all, and only complete checkpoints load.

Module ``torchtitan.components.checkpointer.dcp``:

* A save writes its step folder in place; DCP writes ``.metadata`` last, but a
  save into an existing ``step-N`` folder (resumed with ``--checkpoint.load_step``,
  or the same step saved twice) overwrites the previous complete checkpoint's data
  files before the new ``.metadata`` exists. ``CheckpointManager.dcp_save`` is wrapped
  to write into ``.saving-step_N`` (a name torchtitan's ``step-(\\d+)`` scans never
  match) and, when the save has finished (synchronously, or when the async upload
  future completes), rank 0 moves it to ``step-N`` with one atomic rename (an atomic
  exchange when ``step-N`` exists). An interrupted save therefore never touches the
  last good checkpoint. (``keep_latest_k`` now counts complete checkpoints only: the
  save in flight is not one of them, so one more folder may exist while it runs.)

* ``CheckpointManager._find_load_step`` accepted any ``step-N`` with a ``.metadata``
  file. It is replaced (local folders) by a scan that also checks every file the
  metadata references exists with all its bytes, so a checkpoint written without
  the runtime and cut short (or truncated on disk) is skipped with a report
  fallback entry and the newest complete one is loaded. When step folders exist but none
  is complete, the run stops with one line naming what is wrong with each (upstream would
  log "fresh start" and train from step 1 over them). Rank 0 removes ``.saving-*`` leftovers.
  ``CheckpointManager.dcp_load`` checks the same before loading an explicit step or
  initial path, and names what is missing instead of failing inside DCP.

Remote (fsspec) folders keep upstream behavior, noted in the report. The files
written are plain DCP checkpoints, loadable without this runtime.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from concurrent.futures import Future

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_save",
    "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_load",
    "torchtitan.components.checkpointer.dcp:CheckpointManager._find_load_step",
)

STAGING_PREFIX = ".saving-"
STEP_PATTERN = re.compile(r"step-(\d+)")  # torchtitan's own (re.search) pattern
HF_INDEX = "model.safetensors.index.json"
NOT_ATOMIC = "replaced the previous checkpoint of this step with two renames (no atomic exchange on this file system)"


# -- where a save is written -------------------------------------------------------------
def staging_path(checkpoint_id: str) -> str:
    """``.../step-5`` -> ``.../.saving-step_5``: hidden, and invisible to ``step-(\\d+)`` scans."""
    parent, name = os.path.split(os.path.normpath(checkpoint_id))
    return os.path.join(parent, STAGING_PREFIX + name.replace("-", "_"))


def _rename_exchange(first: str, second: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unavailable."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # file system or kernel without exchange support
    raise OSError(error, f"renameat2({first!r}, {second!r}, RENAME_EXCHANGE): {os.strerror(error)}")


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(staging: str, final: str) -> str:
    """Make the finished save at ``staging`` the checkpoint at ``final``; returns how."""
    if not os.path.isdir(final):
        os.rename(staging, final)  # atomic: readers see no step folder or a complete one
        how = "renamed to step-N"
    elif _rename_exchange(staging, final):
        shutil.rmtree(staging)  # now holds the checkpoint that was replaced
        how = "exchanged atomically with an existing step-N"
    else:
        aside = staging + ".replaced"
        os.rename(final, aside)
        os.rename(staging, final)
        shutil.rmtree(aside)
        how = NOT_ATOMIC
    _fsync_directory(os.path.dirname(os.path.abspath(final)))
    return how


# -- what a complete checkpoint is ---------------------------------------------------------
def checkpoint_problem(path: str) -> str | None:
    """None when ``path`` holds a complete checkpoint, else what is missing."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        from torch.distributed.checkpoint import FileSystemReader

        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:  # any failure to parse it means DCP cannot load this checkpoint
            return f".metadata cannot be read ({type(exc).__name__}: {exc})"
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for relative_path, size in sorted(needed.items()):
            file_path = os.path.join(path, relative_path)
            if not os.path.isfile(file_path):
                return f"{relative_path} is missing"
            actual = os.path.getsize(file_path)
            if actual < size:
                return f"{relative_path} holds {actual} of its {size} bytes"
        return None
    if os.path.isfile(os.path.join(path, HF_INDEX)):
        return None  # a Hugging Face export: torchtitan's own criterion
    return "no .metadata (the save did not finish)"


def newest_complete_step(folder: str, steps: list[tuple[int, str]]) -> tuple[int, list[tuple[str, str]]]:
    """The newest complete step among ``steps`` ((N, "step-N") in ``folder``), -1 when none is,
    and (name, problem) for each newer one that was incomplete."""
    skipped = []
    for step, name in sorted(steps, reverse=True):
        problem = checkpoint_problem(os.path.join(folder, name))
        if problem is None:
            return step, skipped
        skipped.append((name, problem))
    return -1, skipped


def none_complete_message(folder: str, skipped: list[tuple[str, str]]) -> str:
    """One line: every checkpoint in ``folder`` is incomplete; what is wrong with each; how to start fresh."""
    problems = "; ".join(f"{name}: {' '.join(problem.split())}" for name, problem in skipped)
    return (
        f"npu_inject checkpoint_publish: {folder} holds checkpoints but none is complete ({problems}); "
        "resuming would start at step 1 and overwrite them. To start fresh on purpose, move that folder "
        "away, or pass another --checkpoint.folder or --dump_folder"
    )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# -- apply -----------------------------------------------------------------------------------
def apply(ctx: PatchContext) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    from torchtitan.tools import filesystem

    def publish_on_rank0(staging: str, final: str) -> None:
        if _rank() != 0:
            return
        how = publish(staging, final)
        if how == NOT_ATOMIC:
            ctx.fallback(f"{os.path.basename(final)}: {how}")
        else:
            ctx.note(f"checkpoints are written to {STAGING_PREFIX}<step> and {how} once complete")

    def chained(upload: Future, staging: str, final: str) -> Future:
        """A future that completes once ``upload`` did and the checkpoint is published."""
        done: Future = Future()

        def finish(inner: Future) -> None:
            try:
                result = inner.result()
                publish_on_rank0(staging, final)
            except BaseException as exc:  # hand any failure to whoever waits on the save
                done.set_exception(exc)
            else:
                done.set_result(result)

        upload.add_done_callback(finish)
        return done

    def dcp_save(original, manager, state_dict, checkpoint_id, async_mode,
                 enable_garbage_collection=False, to_hf=False):
        final = str(checkpoint_id)
        if filesystem.is_remote(final):
            ctx.note("remote checkpoint folder: saves go straight to step-N (no atomic publish)")
            return original(manager, state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        staging = staging_path(final)
        result = original(manager, state_dict, staging, async_mode, enable_garbage_collection, to_hf)
        if isinstance(result, AsyncSaveResponse):
            return AsyncSaveResponse(
                staging_completion=result.staging_completion,
                upload_completion=chained(result.upload_completion, staging, final),
            )
        if isinstance(result, Future):
            return chained(result, staging, final)
        # Synchronous: dcp.save returned after every rank's data and the .metadata were written.
        publish_on_rank0(staging, final)
        return result

    def find_load_step(original, manager, folder=""):
        folder = folder or manager.folder
        if filesystem.is_remote(folder):
            ctx.note("remote checkpoint folder: the newest step-N with .metadata is loaded unverified")
            return original(manager, folder)
        if not os.path.isdir(folder):
            return -1
        steps = []
        for name in os.listdir(folder):
            if name.startswith(STAGING_PREFIX):
                if _rank() == 0:
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
                    ctx.note(f"removed {name}: leftover of a save that did not finish")
                continue
            match = STEP_PATTERN.search(name)
            if match and os.path.isdir(os.path.join(folder, name)):
                steps.append((int(match.group(1)), name))
        step, skipped = newest_complete_step(folder, steps)
        for name, problem in skipped:
            ctx.fallback(f"checkpoint {name} skipped: incomplete ({problem}); trying an older one")
        if step == -1 and skipped:
            # torchtitan would log "fresh start" and train from step 1 over the user's folder.
            stop_run(none_complete_message(folder, skipped))
        return step

    def dcp_load(original, manager, state_dict, checkpoint_id, from_hf, from_quantized):
        if not from_hf and not filesystem.is_remote(str(checkpoint_id)):
            problem = checkpoint_problem(str(checkpoint_id))
            if problem is not None:
                raise FileNotFoundError(
                    f"checkpoint {checkpoint_id} is incomplete: {problem}. Its save did not finish; load "
                    "another step (--checkpoint.load_step) or leave load_step at -1 to take the newest "
                    "complete one"
                )
        return original(manager, state_dict, checkpoint_id, from_hf, from_quantized)

    ctx.wrap("CheckpointManager.dcp_save", dcp_save)
    ctx.wrap("CheckpointManager.dcp_load", dcp_load)
    ctx.wrap("CheckpointManager._find_load_step", find_load_step)
