"""torchtitan's command line as ``torchtitan.train`` takes it: flags first, tyro's subcommands last."""

from __future__ import annotations

import re

SUBCOMMAND = re.compile(r"^[A-Za-z][\w-]*:[\w.-]+$")  # activation-checkpoint:none; must follow every flag


def with_flags(args: list[str], flags: list[str]) -> list[str]:
    """``args`` with ``flags`` added before its first subcommand (``activation-checkpoint:MODE`` stays last)."""
    position = next((i for i, token in enumerate(args) if SUBCOMMAND.match(token)), len(args))
    return [*args[:position], *flags, *args[position:]]
