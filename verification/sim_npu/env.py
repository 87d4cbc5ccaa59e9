"""Prints the shell line that enables the simulated NPU.

    eval "$(python verification/sim_npu/env.py)"
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from verification.sim_npu import shell_exports

    print(shell_exports())
