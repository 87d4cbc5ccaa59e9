"""The runtime: validates configuration, hooks trigger modules, applies patches.

Activated by the bootstrap when ``torchtitan`` is first executed (or directly by
tests). Activation does all validation first -- environment, registries,
selection, requirement graph -- so a configuration error stops the process
before any patch is applied. Patches then apply lazily: a patch module is
imported only when one of its trigger modules is imported.

The runtime holds each patch's state (:class:`PatchState`); the per-process
:class:`~npu_inject.report.Report` is a view built from it on demand. Two
services are the runtime's own, not switchable patches: cross-rank agreement on
the applied patches and writing each rank's report (:mod:`npu_inject.rank_agreement`).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from npu_inject import module_facts
from npu_inject import selection as selection_mod
from npu_inject import registry as registry_mod
from npu_inject import settings as settings_mod
from npu_inject.errors import ConfigError, PatchError
from npu_inject.report import PatchRecord, Report

logger = logging.getLogger("npu_inject")

# The import that provides the device for each target (None: plain torch).
TARGET_BACKEND_MODULE = {"npu": "torch_npu", "cpu": None}
# Where the runtime's own services hook in (see npu_inject.rank_agreement).
SERVICES_TRIGGER = "torchtitan.trainer"


@dataclass
class PatchState:
    """Where one patch stands. ``context`` holds its changes, notes and fallbacks once it ran."""

    state: str  # one of report.STATES
    reason: str = ""
    trigger: str = ""
    apply_ms: float = 0.0
    context: Any = None  # PatchContext, once apply was attempted


class Runtime:
    def __init__(self, selection: selection_mod.Selection) -> None:
        self.selection = selection
        self.settings = selection.settings
        self.registry = selection.registry
        self.active = True
        self.rank = int(os.environ.get("RANK", "0"))
        self.states: dict[str, PatchState] = {}
        self.modules: dict[str, Any] = {}
        self.versions: dict[str, str | None] = {
            dist: version for dist, version in selection.versions.items() if dist != "torch_npu"}
        self.timings_ms: dict[str, float] = {}
        self.dump_dir: str | None = None
        self.services: Any = None  # PatchContext of the runtime's own hooks
        self._applying: list[str] = []
        self._hooked: set[str] = set()
        for patch_id, (state, reason) in selection.initial.items():
            self.states[patch_id] = PatchState(state, reason)

    # -- the report: a view of the state -----------------------------------------
    @property
    def report(self) -> Report:
        patches = {}
        for patch_id, state in self.states.items():
            context = state.context
            patches[patch_id] = PatchRecord(
                state=state.state, reason=state.reason, trigger=state.trigger, apply_ms=state.apply_ms,
                fallbacks=list(context.fallbacks) if context is not None else [],
                notes=list(context.notes) if context is not None else [],
            )
        return Report(
            target=self.settings.target or "off", strict=self.settings.strict, rank=self.rank,
            versions=dict(self.versions), patches=patches, timings_ms=dict(self.timings_ms),
            registry_sources=list(self.registry.sources),
        )

    def ids(self, state: str) -> list[str]:
        return [patch_id for patch_id, record in self.states.items() if record.state == state]

    # -- hooks -------------------------------------------------------------
    def install_hooks(self) -> None:
        """Go live: hook the trigger modules, write the report at exit."""
        started = time.perf_counter()
        import wrapt

        atexit.register(_write_report_at_exit, self)
        self.timings_ms["wrapt_import"] = _ms(started)
        for trigger in dict.fromkeys((SERVICES_TRIGGER, *self.selection.triggers())):
            if trigger not in self._hooked:
                self._hooked.add(trigger)
                wrapt.register_post_import_hook(self._on_import, trigger)
        # Includes what already-imported triggers applied right away (wrapt fires those at once).
        self.timings_ms["install_hooks"] = _ms(started)

    def _on_import(self, module: Any) -> None:
        if not self.active:
            return
        name = module.__name__
        for patch_id in self.selection.order:
            if self.states[patch_id].state == "pending" and name in self.registry.patches[patch_id].triggers:
                self.apply(patch_id, trigger=name)
        if name == SERVICES_TRIGGER and self.services is None:
            from npu_inject import rank_agreement

            self.services = rank_agreement.install(self)

    # -- applying ----------------------------------------------------------
    def apply(self, patch_id: str, trigger: str = "") -> bool:
        """Apply one patch, all or nothing. True when it is in effect afterwards."""
        state = self.states[patch_id]
        if state.state == "applied":
            return True
        if state.state not in ("pending", "reverted") or patch_id in self._applying:
            return False
        spec = self.registry.patches[patch_id]
        self._applying.append(patch_id)
        try:
            reason = self._requirements_met(spec) or self.selection.version_problem(patch_id)
            if reason:
                return self._not_applied(patch_id, "skipped", reason)
            return self._run_apply(patch_id, spec, trigger)
        finally:
            self._applying.remove(patch_id)

    def _requirements_met(self, spec: registry_mod.PatchSpec) -> str:
        for required in spec.requires:
            if self.states[required].state in ("pending", "reverted"):
                # Apply the requirement first: importing its trigger fires its hook.
                importlib.import_module(self.registry.patches[required].triggers[0])
                self.apply(required)
            if self.states[required].state != "applied":
                return f"requires {required}, which is {self.states[required].state}"
        return ""

    def _run_apply(self, patch_id: str, spec: registry_mod.PatchSpec, trigger: str) -> bool:
        from npu_inject.patching import PatchContext, TargetMissing

        started = time.perf_counter()
        context = PatchContext(patch_id=patch_id, device_kind=self.settings.target, options=dict(spec.options))
        self.states[patch_id].context = context
        try:
            module = importlib.import_module(spec.module)
            self.modules[patch_id] = module
            context.declared_targets = module_facts.declared_names(module)
            module.apply(context)
        except TargetMissing as exc:
            context.restore()
            return self._not_applied(patch_id, "failed", f"target missing: {exc}", exc)
        except Exception as exc:  # any failure: restore what the patch changed, record why
            context.restore()
            return self._not_applied(patch_id, "failed", f"{type(exc).__name__}: {exc}", exc)
        self.states[patch_id] = PatchState("applied", "", trigger, _ms(started), context)
        return True

    def _not_applied(self, patch_id: str, state: str, reason: str,
                     cause: BaseException | None = None) -> bool:
        record = self.states[patch_id]
        record.state, record.reason = state, reason
        logger.warning("npu_inject: patch %s %s: %s", patch_id, state, reason)
        if self.settings.strict:
            raise PatchError(
                f"patch {patch_id!r} {state}: {reason} (TORCHTITAN_NPU_STRICT=1 stops the run; "
                f"unset it to continue without the patch, or disable it with TORCHTITAN_NPU_PATCHES=-{patch_id})"
            ) from cause
        return False

    # -- reverting ---------------------------------------------------------
    def revert(self, patch_id: str) -> None:
        """Restore everything a patch changed; patches requiring it are reverted first."""
        state = self.states[patch_id]
        if state.state != "applied":
            return
        for other_id, other in self.registry.patches.items():
            if patch_id in other.requires:
                self.revert(other_id)
        module = self.modules.get(patch_id)
        revert = getattr(module, "revert", None)  # optional: extra clean-up beyond the context
        if revert is not None:
            revert(state.context)
        state.context.restore()
        state.state, state.reason = "reverted", "reverted; applies again at the next import of its trigger"

    def revert_all(self) -> None:
        for patch_id in reversed(list(self.states)):
            self.revert(patch_id)

    def deactivate(self) -> None:
        """Revert every patch and the runtime's own hooks; make the import hooks inert (tests)."""
        self.revert_all()
        if self.services is not None:
            self.services.restore()
            self.services = None
        self.active = False

    # -- report ------------------------------------------------------------
    def write_report(self, directory: str | None = None) -> str | None:
        directory = directory or self.dump_dir or self.settings.report_dir
        if directory is None:
            return None
        return self.report.write(directory)

    def set_dump_folder(self, dump_folder: str) -> None:
        self.dump_dir = os.path.join(dump_folder, "npu_inject")

    def clear_dump_folder(self) -> None:
        """Forget the job's dump folder (one about to be removed): a later report goes to the settings' report
        folder, if any."""
        self.dump_dir = None


_RUNTIME: Runtime | None = None


def current() -> Runtime | None:
    return _RUNTIME


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000.0, 3)


def _import_backend(runtime: Runtime) -> None:
    backend = TARGET_BACKEND_MODULE[runtime.settings.target]
    if backend is None:
        return
    started = time.perf_counter()
    try:
        module = importlib.import_module(backend)
    except ImportError as exc:
        raise ConfigError(
            f"{settings_mod.ENV_TARGET}={os.environ.get(settings_mod.ENV_TARGET)!r} needs {backend}, "
            f"which failed to import: {exc}. To rehearse this run on a machine without an NPU, "
            f"set {settings_mod.ENV_TARGET}=cpu."
        ) from exc
    runtime.timings_ms[f"{backend}_import"] = _ms(started)
    runtime.versions[backend] = getattr(module, "__version__", None) or selection_mod.installed_version(backend)
    if getattr(module, "__simulated__", False):
        runtime.versions[f"{backend}_simulated"] = "yes"


def activate(environ: dict | None = None, *, install_hooks: bool = True) -> Runtime | None:
    """Validate everything, then hook the enabled patches' trigger modules.

    ``environ`` (tests) replaces ``os.environ`` as what the process's settings are read
    from. Raises ConfigError before touching anything when the configuration is bad.
    """
    global _RUNTIME
    if _RUNTIME is not None and _RUNTIME.active:
        return _RUNTIME
    started = time.perf_counter()
    selection = selection_mod.establish(environ)
    if not selection.settings.enabled:
        return None
    runtime = Runtime(selection)
    _import_backend(runtime)
    _RUNTIME = runtime
    if install_hooks:
        runtime.install_hooks()
    runtime.timings_ms["activate"] = _ms(started)
    return runtime


def deactivate() -> None:
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.deactivate()
    _RUNTIME = None
    selection_mod.forget()


def _write_report_at_exit(runtime: Runtime) -> None:
    if runtime.active:
        runtime.write_report()
