"""The wheel: npu_inject only (patches inside it), registry.json inside, the .pth at the root."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from testkit import REPO


def test_wheel_layout(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), REPO],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("npu_inject-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"npu_inject", "npu_inject_bootstrap.pth", wheel.name.split("-")[0] + "-" +
                         wheel.name.split("-")[1] + ".dist-info"}, top_level
    assert "npu_inject/registry.json" in names
    assert "npu_inject/patches/attention.py" in names and "npu_inject/patches/device.py" in names
    assert not any(name.startswith(("patches/", "tools/", "tests/", "verification/")) for name in names)
    assert "npu_inject/commands/cli.py" in names and "npu_inject/selection.py" in names
    pth = zipfile.ZipFile(wheel).read("npu_inject_bootstrap.pth").decode()
    assert pth.startswith("import os; os.environ.get('TORCHTITAN_NPU'")
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for dependency in ("torch", "torchtitan", "wrapt", "importlib-metadata", "packaging"):
        assert any(line.split()[1].startswith(dependency) for line in requires), dependency
    assert not any(line.split()[1] == "torch" and "==" in line for line in requires), "torch must not be pinned"
    # the project's licence travels with the wheel, named in its metadata
    (licence,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
    assert zipfile.ZipFile(wheel).read(licence).decode().startswith("BSD 3-Clause License")
    assert "License-Expression: BSD-3-Clause" in metadata and "License-File: LICENSE" in metadata
