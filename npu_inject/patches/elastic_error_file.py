"""A failing rank's error file is written whole or not at all, so torchrun restarts the group instead of crashing.

Module ``torch.distributed.elastic.multiprocessing.errors.error_handler`` (through ``torchtitan.trainer``,
whose ``Trainer.__init__`` and ``Trainer.train`` carry torch's ``@record``).

``@record`` writes a failing rank's exception to ``TORCHELASTIC_ERROR_FILE`` with ``json.dump`` into a file
it has just truncated. When another rank of the group has died, torchrun's agent SIGTERMs the survivors and
then reads every failed rank's error file; a survivor stopped between the truncation and the write leaves
an empty file, and ``json.load`` raises in the agent (torch 2.14's ``ProcessFailure``): torchrun itself dies
with a JSONDecodeError, and ``--max-restarts`` never restarts the group. Seen on the rehearsal when rank 1
was SIGKILLed and rank 0 raised gloo's connection error at the same moment.

Here the record is written to a file beside it and renamed over the error file (atomic on one file system):
the agent finds the whole record, or none (it then reports the exit code, as for a SIGKILL). Outside
torchrun (no ``TORCHELASTIC_ERROR_FILE``) torch only logs the exception, and nothing changes.
"""

from __future__ import annotations

import os

from npu_inject.patching import PatchContext

TARGETS = (
    "torch.distributed.elastic.multiprocessing.errors.error_handler:ErrorHandler.record_exception",
)


def apply(ctx: PatchContext) -> None:
    def record_exception(original, handler, exception):
        error_file = handler._get_error_file_path()
        if not error_file:
            return original(handler, exception)
        partial = f"{error_file}.{os.getpid()}.partial"
        # the instance attribute shadows the method for this call only: torch's own record, at another path
        handler._get_error_file_path = lambda: partial
        try:
            result = original(handler, exception)
        finally:
            del handler._get_error_file_path
        os.replace(partial, error_file)
        return result

    ctx.wrap("ErrorHandler.record_exception", record_exception)
