"""What a run will do, computed once: settings, catalog, selection, versions, apply order.

The runtime builds the selection at activation and applies it; the CLI (``list``, ``show``,
``check``, ``doctor``) builds the same selection from the same environment and prints it, so the
two cannot disagree on which patches are on. The ops layer asks :func:`current_target` which
kernels to run. Stdlib only (plus :mod:`packaging` through the registry): the selection is made
before torch or torchtitan are imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from npu_inject import registry as registry_mod
from npu_inject import settings as settings_mod


@dataclass(frozen=True)
class Selection:
    settings: settings_mod.Settings
    registry: registry_mod.Registry
    enabled: Mapping[str, bool]  # the selection applied over the catalog's defaults
    initial: Mapping[str, tuple[str, str]]  # patch id -> (state, reason) before any trigger import
    order: tuple[str, ...]  # the pending patches, each after the patches it requires
    versions: Mapping[str, str | None]  # installed version of each distribution a patch may constrain

    @property
    def target(self) -> str | None:
        """"npu", "cpu" (rehearsal) or None (runtime off)."""
        return self.settings.target

    def state(self, patch_id: str) -> str:
        return self.initial[patch_id][0]

    def triggers(self) -> tuple[str, ...]:
        """Modules whose import applies a pending patch, in apply order, each once."""
        names = (trigger for patch_id in self.order for trigger in self.registry.patches[patch_id].triggers)
        return tuple(dict.fromkeys(names))

    def version_problem(self, patch_id: str) -> str:
        """Why the installed versions do not fit the patch's ``supports`` ('' when they do)."""
        return registry_mod.version_problem(self.registry.patches[patch_id], self.target, self.versions.get)


def make(environ: os._Environ | dict | None = None) -> Selection:
    """Read and validate the environment (or ``environ``) and the registries; raises ConfigError."""
    settings = settings_mod.load(environ)
    registry = registry_mod.load(settings.registry_path)
    enabled = registry_mod.select(registry, settings.patches)
    initial = {patch_id: registry_mod.initial_state(spec, enabled, settings.target)
               for patch_id, spec in registry.patches.items()}
    pending = [patch_id for patch_id, (state, _) in initial.items() if state == "pending"]
    versions = {dist: registry_mod.installed_version(dist) for dist in registry_mod.VERSIONED_DISTRIBUTIONS}
    return Selection(settings, registry, MappingProxyType(enabled), MappingProxyType(initial),
                tuple(registry_mod.apply_order(registry, pending)), MappingProxyType(versions))


# The process's selection: made by the runtime at activation (or by a tool that runs kernels outside a
# training run, e.g. tests and benchmarks, through establish()). The ops layer reads its target.
_current: Selection | None = None


def establish(environ: os._Environ | dict | None = None) -> Selection:
    """Make the plan from the environment (or ``environ``) and make it the process's selection."""
    global _current
    _current = make(environ)
    return _current


def current() -> Selection | None:
    return _current


def current_target() -> str | None:
    """The target the process's selection runs for; there must be one (no guessing from os.environ)."""
    if _current is None:
        raise RuntimeError(
            "npu_inject: no selection in this process, so no target to pick kernels for; the runtime makes one "
            "when TORCHTITAN_NPU is set and torchtitan is imported (code running kernels outside a "
            "training run calls npu_inject.selection.establish({'TORCHTITAN_NPU': 'cpu'}) or 'npu' first)"
        )
    return _current.target


def forget() -> None:
    """Drop the process's selection (the runtime's deactivate; tests)."""
    global _current
    _current = None
