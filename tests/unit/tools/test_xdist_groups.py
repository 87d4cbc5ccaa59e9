"""The installed pytest and pytest-xdist honour ``xdist_group``: tests/conftest.py keeps the tests that share a
run on one worker (so each run is made once) and the torchft runs one at a time. With pytest 9.2, xdist 3.8's
grouping silently did nothing (it renames ``item._nodeid``, which pytest 9.2 no longer reads)."""

import subprocess
import sys
import textwrap


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.xdist_group("shared_run")
        def test_a():
            pass

        @pytest.mark.xdist_group("shared_run")
        def test_b():
            pass
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "-v", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    workers = {line.split()[0] for line in done.stdout.splitlines() if "PASSED" in line}
    assert len(workers) == 1 and "test_a@shared_run" in done.stdout, done.stdout[-2000:]
