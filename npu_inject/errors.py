"""Exceptions raised by the runtime. Stdlib only: imported on the start-up path."""

import sys
from typing import NoReturn


class ConfigError(Exception):
    """Bad user input (environment, registry file, patch selection).

    Raised before any patch is applied, so a misconfigured run stops before the
    trainer is built and never after a partial set of patches took effect.
    """


class PatchError(Exception):
    """A patch could not apply (only raised in strict mode; otherwise recorded)."""


class RunStopped(SystemExit):
    """A run stopped on purpose with one line (:func:`stop_run`); exit status 1, ``str()`` is the line."""

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


def stop_run(message: str) -> NoReturn:
    """Stop this process with ``message`` as one line on stderr.

    Every rank of a launch stops with the same line into the launcher's shared pipe. Python's own report
    of ``SystemExit(message)`` writes the message and its newline in two writes, so eight ranks' lines run
    into each other; one write of a short line on a pipe is never split.
    """
    sys.stdout.flush()
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    raise RunStopped(message)
