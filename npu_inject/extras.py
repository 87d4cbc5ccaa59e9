"""How to install an optional package: the line a stop or a report names, from this distribution's own extras.

npu-inject is installed from a clone (it is not on PyPI), so ``pip install 'npu-inject[torchft]'`` would
fail; what works anywhere is the package itself at the version the extra pins. The extras and their pins are
read from the installed distribution's metadata (``Requires-Dist: torchft~=0.2.0; extra == "torchft"``), the
one place they are written (pyproject.toml). Stdlib only, plus :mod:`packaging` (imported when asked).
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, requires

DISTRIBUTION = "npu-inject"
TEST_EXTRA = "test"


@functools.lru_cache(maxsize=None)
def _pinned() -> dict[str, tuple[str, str]]:
    """distribution (normalised) -> (its requirement without the marker, the extra that brings it: a user's
    extra rather than the test extra, which brings every package the tests need)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        lines = requires(DISTRIBUTION) or []
    except PackageNotFoundError:  # run from a source tree that was never installed: no extras to name
        return {}
    pinned: dict[str, tuple[str, str]] = {}
    for line in lines:
        requirement = Requirement(line)
        marker = str(requirement.marker or "")
        if "extra" not in marker:
            continue
        extra = marker.split("==", 1)[1].strip().strip("'\"")
        requirement.marker = None
        name = canonicalize_name(requirement.name)
        if name not in pinned or pinned[name][1] == TEST_EXTRA:
            pinned[name] = (str(requirement), extra)
    return pinned


def install_hint(distribution: str) -> str:
    """``pip install 'torchft~=0.2.0' (npu-inject's torchft extra)``: how to get ``distribution``."""
    from packaging.utils import canonicalize_name

    found = _pinned().get(canonicalize_name(distribution))
    if found is None:
        return f"pip install {distribution}"
    requirement, extra = found
    return f"pip install '{requirement}' (npu-inject's {extra} extra)"
