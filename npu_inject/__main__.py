"""``python -m npu_inject``: the same CLI as ``npu-inject``."""

import sys

from npu_inject.commands.cli import main

if __name__ == "__main__":  # the planner's worker processes import this module as __mp_main__
    sys.exit(main())
