"""Offline commands (``npu-inject ...``): list/show/check/doctor, compare, audit, selftest.

None of these runs inside a training process.
"""
