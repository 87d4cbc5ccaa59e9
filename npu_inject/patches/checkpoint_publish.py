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

* Checksums: DCP's ``FileSystem.create_stream`` is wrapped so that each data file
  (``*.distcp``) is summed (size and CRC-32) as its bytes are written, not read back
  afterwards, and the sum lands beside it as ``.<file>.checksum.json``. A resume verifies
  the checkpoint it is about to load: the ranks split its files, each reads its share once,
  and all agree on the first problem (an all-gather). A file changed since it was written
  (same size or not) or gone stops every rank with one line naming it and the newest
  earlier checkpoint that verifies, instead of training on from garbage; a checkpoint with
  checksums that lost bytes is damaged, not skipped as an unfinished save. A checkpoint in
  which any data file has a checksum was written with them: a data file without its own
  then stops the same way (deleting a sum must not switch checking off for that file), and
  a checksum file that is not JSON or lacks its fields is named as the fault, not the data.
  Every async mode writes them (the writers run in the training process). A checkpoint
  without any checksum (written without the runtime) is checked for presence and sizes
  only, said in the report.
  Cost: one CRC-32 pass over the bytes as they are written, and one read of the checkpoint,
  split over the ranks, at resume.

Remote (fsspec) folders keep upstream behavior, noted in the report. The files
written are plain DCP checkpoints, loadable without this runtime (DCP reads the files
``.metadata`` names and ignores the checksum files).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import zlib
from concurrent.futures import Future

from npu_inject.errors import stop_run
from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_save",
    "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_load",
    "torchtitan.components.checkpointer.dcp:CheckpointManager._find_load_step",
    "torch.distributed.checkpoint.filesystem:FileSystem.create_stream",
)

STAGING_PREFIX = ".saving-"
STEP_PATTERN = re.compile(r"step-(\d+)")  # torchtitan's own (re.search) pattern
HF_INDEX = "model.safetensors.index.json"
DATA_SUFFIX = ".distcp"  # DCP's data files; .metadata is a pickle DCP itself refuses when damaged
CHECKSUM_SUFFIX = ".checksum.json"
READ_CHUNK = 16 << 20
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


# -- checksums: summed as written, verified before a resume loads --------------------------
class SummingStream:
    """A data file being written: every write goes to the file and into its size and CRC-32."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.size = 0
        self.crc32 = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        return self._stream.write(data)

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self._stream, name)


def checksum_path(data_path: str) -> str:
    folder, name = os.path.split(data_path)
    return os.path.join(folder, f".{name}{CHECKSUM_SUFFIX}")


@contextlib.contextmanager
def summed(opened, data_path: str):
    """``opened`` (DCP's stream context for a data file), summed; the sum is written once the file is closed."""
    with opened as stream:
        summing = SummingStream(stream)
        yield summing
    with open(checksum_path(data_path), "w", encoding="utf-8") as handle:
        json.dump({"size": summing.size, "crc32": summing.crc32}, handle)


def checksum_files(path: str) -> list[str]:
    """The data files of checkpoint ``path`` that carry a checksum, sorted."""
    return sorted(name[1:-len(CHECKSUM_SUFFIX)] for name in os.listdir(path)
                  if name.startswith(".") and name.endswith(DATA_SUFFIX + CHECKSUM_SUFFIX))


def data_files(path: str) -> list[str]:
    """The data files of checkpoint ``path`` to verify: those on disk and those a checksum names, sorted."""
    return sorted(set(checksum_files(path)) | {name for name in os.listdir(path) if name.endswith(DATA_SUFFIX)})


SUM_FAULT = "checksum file "  # how a problem with the sum itself (not with its data file) begins


def read_sum(path: str, name: str) -> dict | str:
    """The size and CRC-32 written for data file ``name`` of checkpoint ``path``, or what is wrong with its sum."""
    sum_name = os.path.basename(checksum_path(name))
    valid = 'valid is {"size": <bytes>, "crc32": <CRC-32>}, both integers, as the runtime writes it'
    try:
        with open(os.path.join(path, sum_name), encoding="utf-8") as handle:
            written = json.load(handle)
    except FileNotFoundError:
        others = next(other for other in checksum_files(path) if other != name)
        return (f"{SUM_FAULT}{sum_name} is missing (the checkpoint was written with checksums: {others} has "
                f"its own), so {name} cannot be checked")
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError: an edited or overwritten sum
        return f"{SUM_FAULT}{sum_name} is not valid JSON ({type(exc).__name__}: {exc}; {valid})"
    missing = [key for key in ("size", "crc32") if not isinstance(written, dict) or type(written.get(key)) is not int]
    if missing:
        return (f"{SUM_FAULT}{sum_name} lacks an integer {' and '.join(map(repr, missing))} "
                f"(it holds {json.dumps(written)[:80]}; {valid})")
    return written


def file_problem(path: str, name: str) -> str | None:
    """None when data file ``name`` of checkpoint ``path`` holds exactly what was written, else what differs
    (beginning with SUM_FAULT when the sum itself is missing or unreadable)."""
    written = read_sum(path, name)
    if isinstance(written, str):
        return written
    data_path = os.path.join(path, name)
    if not os.path.isfile(data_path):
        return f"{name} is missing"
    actual_size = os.path.getsize(data_path)
    if actual_size != written["size"]:
        return f"{name} holds {actual_size} bytes, {written['size']} were written"
    crc = 0
    with open(data_path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    if crc != written["crc32"]:
        return f"{name} changed since it was written (CRC-32 {crc:08x}, written {written['crc32']:08x})"
    return None


def checksum_problem(path: str, rank: int = 0, world_size: int = 1) -> str | None:
    """This rank's share of checkpoint ``path``'s files (every ``world_size``-th from ``rank``), verified:
    the first problem, or None."""
    for name in data_files(path)[rank::world_size]:
        problem = file_problem(path, name)
        if problem is not None:
            return problem
    return None


def _agreed_checksum_problem(path: str) -> str | None:
    """checksum_problem with the files split over the job's ranks; every rank returns the same answer."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return checksum_problem(path)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    problems: list[str | None] = [None] * world_size
    dist.all_gather_object(problems, checksum_problem(path, rank, world_size))
    return next((problem for problem in problems if problem is not None), None)


def damaged_message(folder: str, name: str, problem: str, intact: str | None, searched: bool = True) -> str:
    """One line: checkpoint ``name`` changed after it was written (or a checksum file of it is missing or
    unreadable), and where to resume instead: the newest intact earlier one when ``searched``, else how to find it."""
    if not searched:
        offer = "Load another step (--checkpoint.load_step), or leave load_step at -1 to find the newest intact one"
    elif intact:
        offer = (f"The newest intact checkpoint is {intact}: resume from it with --checkpoint.load_step "
                 f"{STEP_PATTERN.search(intact).group(1)}, or move {name} away")
    else:
        offer = "No earlier checkpoint verifies; move the folder away to start fresh"
    if problem.startswith(SUM_FAULT):
        return (f"npu_inject checkpoint_publish: checkpoint {os.path.join(folder, name)} cannot be verified: "
                f"{problem}. The fault is in the checksum file (the data may be intact), but loading unverified "
                f"data could train on from garbage. {offer}")
    return (f"npu_inject checkpoint_publish: checkpoint {os.path.join(folder, name)} is damaged: {problem}; "
            f"loading it would train on from garbage. {offer}")


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

    verified: set[str] = set()  # checkpoints this process verified (find_load_step, then dcp_load)
    unsummed: set[str] = set()

    def create_stream(original, fs, path, mode):
        if mode != "wb" or not str(path).endswith(DATA_SUFFIX):
            return original(fs, path, mode)
        return summed(original(fs, path, mode), str(path))

    def verify(path: str) -> str | None:
        """The agreed problem with checkpoint ``path``'s checksums (None: intact, or none to check)."""
        path = os.path.normpath(path)
        if path in verified:
            return None
        if not checksum_files(path):
            if path not in unsummed:
                unsummed.add(path)
                ctx.fallback(f"checkpoint {os.path.basename(path)} carries no checksums (written without the "
                             "runtime): only its files' presence and sizes are checked")
            return None
        problem = _agreed_checksum_problem(path)
        if problem is None:
            verified.add(path)
        return problem

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
        # A newer checkpoint with checksums was published whole by the runtime: incomplete now means damaged.
        damaged = next((name for name, _ in skipped if checksum_files(os.path.join(folder, name))), None)
        if damaged is None:
            for name, problem in skipped:
                ctx.fallback(f"checkpoint {name} skipped: incomplete ({problem}); trying an older one")
            if step == -1 and skipped:
                # torchtitan would log "fresh start" and train from step 1 over the user's folder.
                stop_run(none_complete_message(folder, skipped))
            if step == -1:
                return step
            name = dict(steps)[step]
            problem = verify(os.path.join(folder, name))
        else:
            name = damaged
            problem = verify(os.path.join(folder, name)) or dict(skipped)[name]
        if problem is not None:
            newest = next(n for n, step_name in steps if step_name == name)
            intact = next((older for n, older in sorted(steps, reverse=True) if n < newest
                           and checkpoint_problem(os.path.join(folder, older)) is None
                           and verify(os.path.join(folder, older)) is None), None)
            stop_run(damaged_message(folder, name, problem, intact))
        return step

    def dcp_load(original, manager, state_dict, checkpoint_id, from_hf, from_quantized):
        if not from_hf and not filesystem.is_remote(str(checkpoint_id)):
            path = str(checkpoint_id)
            if os.path.isdir(path) and checksum_files(path):  # published whole by the runtime: verify it
                problem = verify(path) or checkpoint_problem(path)
                if problem is not None:
                    folder, name = os.path.split(os.path.normpath(path))
                    stop_run(damaged_message(folder, name, problem, None, searched=False))
            else:
                problem = checkpoint_problem(path)
                if problem is not None:
                    raise FileNotFoundError(
                        f"checkpoint {checkpoint_id} is incomplete: {problem}. Its save did not finish; load "
                        "another step (--checkpoint.load_step) or leave load_step at -1 to take the newest "
                        "complete one"
                    )
                verify(path)  # says in the report that it carries no checksums
        return original(manager, state_dict, checkpoint_id, from_hf, from_quantized)

    ctx.wrap("CheckpointManager.dcp_save", dcp_save)
    ctx.wrap("CheckpointManager.dcp_load", dcp_load)
    ctx.wrap("CheckpointManager._find_load_step", find_load_step)
    ctx.wrap("FileSystem.create_stream", create_stream)
