"""Hatch build hook: put the bootstrap .pth file into site-packages.

Both a regular wheel and an editable install get it; the file only acts when
TORCHTITAN_NPU is set (see npu_inject/_bootstrap.py).
"""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH_SOURCE = "npu_inject_bootstrap.pth"
PTH_INSTALLED = "npu_inject_bootstrap.pth"


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        build_data["force_include"][PTH_SOURCE] = PTH_INSTALLED
        build_data["force_include_editable"][PTH_SOURCE] = PTH_INSTALLED
