"""Prebuilds the simulated NPU's C++ extension (CI runs this once before tests).

    python verification/sim_npu/build.py [--verbose]

Importing the stand-in torch_npu builds it on demand too; this just moves the
one-time compile (about half a minute on 2 cores) out of the first test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _build
    import torch

    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")
    started = time.monotonic()
    _build.load_extension(verbose=args.verbose)
    print(
        f"simulated NPU extension ready in {_build.build_directory()} "
        f"({time.monotonic() - started:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
