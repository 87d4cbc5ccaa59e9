"""Prints the shell lines that make the real torch_npu load the CANN emulation.

    eval "$(.venv-cann/bin/python verification/cann_emu/env.py)"
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from verification.cann_emu import shell_exports

    try:
        print(shell_exports())
    except FileNotFoundError as error:
        sys.exit(f"cann_emu: {error}")
