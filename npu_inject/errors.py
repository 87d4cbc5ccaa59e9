"""Exceptions raised by the runtime. Stdlib only: imported on the start-up path."""


class ConfigError(Exception):
    """Bad user input (environment, registry file, patch selection).

    Raised before any patch is applied, so a misconfigured run stops before the
    trainer is built and never after a partial set of patches took effect.
    """


class PatchError(Exception):
    """A patch could not apply (only raised in strict mode; otherwise recorded)."""
