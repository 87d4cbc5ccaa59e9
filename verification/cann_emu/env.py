"""Prints the shell lines that make the real torch_npu load the CANN emulation.

    eval "$(.venv-cann/bin/python verification/cann_emu/env.py)"
    eval "$(.venv-cann/bin/python verification/cann_emu/env.py --counts /tmp/counts_{pid}.json)"

``--counts PATH``: each process writes what torch_npu asked of CANN per training step there
(``{pid}`` becomes the process id, ``{rank}`` torchrun's RANK, and then only ranks write; read them with
counts.py, or name them ``<dump>/npu_inject/cann_emu_rank{rank}.json`` for ``npu-inject audit <dump>``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import argparse

    from verification.cann_emu import shell_exports

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", help="per-process, per-step counts file ({pid} becomes the process id, {rank} the rank)")
    args = parser.parse_args()
    try:
        print(shell_exports(counts=args.counts))
    except FileNotFoundError as error:
        sys.exit(f"cann_emu: {error}")
