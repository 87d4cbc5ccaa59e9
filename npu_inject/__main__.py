"""``python -m npu_inject``: the same CLI as ``npu-inject``."""

import sys

from npu_inject.commands.cli import main

sys.exit(main())
