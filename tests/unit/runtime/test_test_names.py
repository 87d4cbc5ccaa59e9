"""Every test module's file name is unique among those one pytest process collects: pytest imports them by
basename (tests/ has no packages), and a second test_spikes.py failed collection of both in a full run only.
tests/sim/unit is collected in its own simulator processes (tests/sim/test_unit_suites.py), apart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_share_a_file_name():
    collected = [path for path in TESTS.rglob("test_*.py")
                 if "__pycache__" not in path.parts and path.parent != TESTS / "sim" / "unit"]
    names = Counter(path.name for path in collected)
    shared = sorted(name for name, count in names.items() if count > 1)
    assert not shared, [sorted(str(path.relative_to(TESTS)) for path in collected if path.name == name)
                        for name in shared]
