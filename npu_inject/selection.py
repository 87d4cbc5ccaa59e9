"""What one environment makes of the catalog, computed once: settings, selection, versions, apply order.

:mod:`npu_inject.registry` is the catalog (what exists); this module applies an environment to it:
the ``TORCHTITAN_NPU_PATCHES`` selection over the catalog's defaults (:func:`select`), each patch's
state before its trigger is imported (:func:`initial_state`), the installed versions against each
patch's ``supports`` (:func:`version_problem`) and the order requirements impose (:func:`apply_order`).
The runtime builds the selection at activation and applies it; the CLI (``list``, ``show``,
``check``, ``doctor``) builds the same selection from the same environment and prints it, so the
two cannot disagree on which patches are on. The ops layer asks :func:`current_target` which
kernels to run. Stdlib only (plus :mod:`packaging` for version specifiers, imported lazily): the
selection is made before torch or torchtitan are imported.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from npu_inject import registry as registry_mod
from npu_inject import settings as settings_mod
from npu_inject.errors import ConfigError


def installed_version(distribution: str) -> str | None:
    """The version of ``distribution`` installed in this environment; None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def select(registry: registry_mod.Registry, selection: str,
           variable: str = "TORCHTITAN_NPU_PATCHES") -> dict[str, bool]:
    """Apply a selection string over the registry defaults.

    Comma-separated entries, left to right: ``all`` / ``none`` reset the set;
    ``+ID`` / ``-ID`` add or remove; bare ``ID`` entries name exactly the
    patches to enable (the defaults are ignored when any bare id is given).
    """
    tokens = [token.strip() for token in selection.split(",")] if selection.strip() else []
    for position, token in enumerate(tokens, start=1):
        if token in ("", "+", "-"):
            raise ConfigError(
                f"{variable}={selection!r}: entry {position} ({token!r}) names no patch; "
                "each comma-separated entry is all, none, ID, +ID or -ID"
            )
    enabled = {patch_id: spec.default for patch_id, spec in registry.patches.items()}
    named: set[str] = set()  # ids the selection names (on or off), as opposed to defaults
    if any(token not in ("all", "none") and token[0] not in "+-" for token in tokens):
        enabled = dict.fromkeys(enabled, False)
    for token in tokens:
        if token in ("all", "none"):
            enabled = dict.fromkeys(enabled, token == "all")
            named = set(registry.patches)
            continue
        sign, name = (token[0], token[1:]) if token[0] in "+-" else ("", token)
        if name not in registry.patches:
            if name in registry_mod.RETIRED_IDS:
                raise ConfigError(f"{variable}: {name!r} is no longer a patch: {registry_mod.RETIRED_IDS[name]}")
            raise ConfigError(f"{variable}: {registry_mod.unknown_id_message(name, registry.patches, 'patch id')}")
        enabled[name] = sign != "-"
        named.add(name)
    # A patch on by default follows a requirement the selection switched off (-attention also
    # turns off what builds on attention); one the selection itself asks for is a contradiction.
    changed = True
    while changed:
        changed = False
        for patch_id, on in enabled.items():
            if not on:
                continue
            for required in registry.patches[patch_id].requires:
                if enabled[required]:
                    continue
                if patch_id in named:
                    raise ConfigError(
                        f"{variable}: patch {patch_id!r} requires {required!r}, which is disabled; "
                        f"enable it (+{required}) or disable {patch_id!r} (-{patch_id})"
                    )
                enabled[patch_id], changed = False, True
    return enabled


NOT_APPLICABLE = "not applicable"


def missing_packages(spec: registry_mod.PatchSpec, version_of=None) -> list[str]:
    """The optional distributions ``spec`` patches (its ``packages``) that are not installed."""
    version_of = version_of or installed_version
    return [distribution for distribution in spec.packages if version_of(distribution) is None]


def initial_state(spec: registry_mod.PatchSpec, enabled: Mapping[str, bool], target: str | None,
                  version_of=None) -> tuple[str, str]:
    """(state, reason) of a patch before its trigger is imported: 'disabled', 'not applicable' (an optional
    package it patches is not installed: nothing to patch, and nothing wrong) or 'pending'.

    ``enabled`` is :func:`select`'s result for the whole registry.
    """
    if not enabled[spec.id]:
        off = [required for required in spec.requires if not enabled[required]]
        if off:
            return "disabled", f"off: requires {', '.join(off)}, which the selection turned off"
        return "disabled", "off by selection"
    if target is not None and target not in spec.runs_on:
        return "disabled", f"runs only on {', '.join(spec.runs_on)}"
    missing = missing_packages(spec, version_of)
    if missing:
        from npu_inject.extras import install_hint

        return NOT_APPLICABLE, "; ".join(f"{name} is not installed; to use it: {install_hint(name)}" for name in missing)
    return "pending", f"waiting for import of {' or '.join(spec.triggers)}"


def version_problem(spec: registry_mod.PatchSpec, target: str | None, version_of=installed_version) -> str:
    """Why the installed versions do not fit ``spec.supports`` ('' when they do).

    torch_npu is only checked on the NPU target: the rehearsal runs reference kernels.
    """
    from packaging.specifiers import SpecifierSet

    for distribution, specifier in spec.supports.items():
        if distribution == "torch_npu" and target != "npu":
            continue
        version = version_of(distribution)
        if version is None:
            return f"{distribution} is not installed (needs {specifier})"
        if not SpecifierSet(specifier).contains(version, prereleases=True):
            return f"{distribution} {version} is outside the supported range {specifier}"
    return ""


def apply_order(registry: registry_mod.Registry, patch_ids: list[str]) -> list[str]:
    """Requirements before the patches that need them (stable otherwise)."""
    ordered: list[str] = []

    def visit(patch_id: str) -> None:
        if patch_id in ordered:
            return
        for required in registry.patches[patch_id].requires:
            visit(required)
        ordered.append(patch_id)

    for patch_id in patch_ids:
        visit(patch_id)
    return ordered



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
        return version_problem(self.registry.patches[patch_id], self.target, self.versions.get)


def make(environ: os._Environ | dict | None = None) -> Selection:
    """Read and validate the environment (or ``environ``) and the registries; raises ConfigError."""
    settings = settings_mod.load(environ)
    registry = registry_mod.load(settings.registry_path)
    enabled = select(registry, settings.patches)
    if settings.faults and not enabled.get("inject_faults"):
        # Faults asked for and silently not caused would make a recovery test pass for nothing.
        raise ConfigError(f"{settings_mod.ENV_FAULTS} asks for faults but patch inject_faults is not enabled; "
                          f"add +inject_faults to {settings_mod.ENV_PATCHES} or unset {settings_mod.ENV_FAULTS}")
    if not enabled.get("matmul_checks"):
        # a variable that silently does nothing, a fault never caused: both stop at start-up
        if settings.sdc_every is not None:
            raise ConfigError(f"{settings_mod.ENV_SDC_EVERY} is set but patch matmul_checks is not enabled; add "
                              f"+matmul_checks to {settings_mod.ENV_PATCHES} or unset {settings_mod.ENV_SDC_EVERY}")
        wanted = [fault.item for fault in settings.faults if fault.kind in ("sdc_matmul", "sdc_expert")]
        if wanted:
            raise ConfigError(f"{settings_mod.ENV_FAULTS}: {wanted[0]!r} corrupts a checked matmul, but patch "
                              f"matmul_checks is not enabled; add +matmul_checks to {settings_mod.ENV_PATCHES}")
    installed = functools.lru_cache(maxsize=None)(installed_version)  # one lookup per distribution
    initial = {patch_id: initial_state(spec, enabled, settings.target, installed)
               for patch_id, spec in registry.patches.items()}
    pending = [patch_id for patch_id, (state, _) in initial.items() if state == "pending"]
    versions = {dist: installed_version(dist) for dist in registry_mod.VERSIONED_DISTRIBUTIONS}
    return Selection(settings, registry, MappingProxyType(enabled), MappingProxyType(initial),
                     tuple(apply_order(registry, pending)), MappingProxyType(versions))


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
