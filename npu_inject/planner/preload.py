"""Imported by the planner's fork server (:mod:`npu_inject.planner.workers`): the preloaded state."""

from npu_inject.planner.workers import preload

preload()
