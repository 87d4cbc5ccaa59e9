"""Test-only verification machinery: the simulated NPU (sim_npu/). Never installed, never imported by npu_inject."""
