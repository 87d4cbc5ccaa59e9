"""The runtime: validates configuration, hooks trigger modules, applies patches.

Activated by the bootstrap at the first ``import torchtitan`` (or directly by
tests). Activation does all validation first -- environment, registries,
selection, requirement graph -- so a configuration error stops the process
before any patch is applied. Patches then apply lazily: a patch module is
imported only when one of its trigger modules is imported.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import time
from typing import Any, Callable

from npu_inject import registry as registry_mod
from npu_inject import settings as settings_mod
from npu_inject.errors import ConfigError, PatchError
from npu_inject.report import Report

logger = logging.getLogger("npu_inject")

# The import that provides the device for each target (None: plain torch).
TARGET_BACKEND_MODULE = {"npu": "torch_npu", "cpu": None}


def installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


class Runtime:
    def __init__(self, settings: settings_mod.Settings, registry: registry_mod.Registry,
                 enabled: dict[str, bool]) -> None:
        self.settings = settings
        self.registry = registry
        self.enabled = enabled
        self.active = True
        self.contexts: dict[str, Any] = {}
        self.modules: dict[str, Any] = {}
        self.report = Report(
            target=settings.target or "off",
            strict=settings.strict,
            rank=int(os.environ.get("RANK", "0")),
            registry_sources=list(registry.sources),
        )
        self.dump_dir: str | None = None
        self._applying: list[str] = []
        self._hooked: set[str] = set()
        for patch_id, spec in registry.patches.items():
            if not enabled[patch_id]:
                self.report.set(patch_id, "disabled", "off by selection")
            elif settings.target not in spec.runs_on:
                self.report.set(patch_id, "disabled", f"runs only on {', '.join(spec.runs_on)}")
            else:
                self.report.set(patch_id, "pending", f"waiting for import of {' or '.join(spec.triggers)}")

    # -- hooks -------------------------------------------------------------
    def wanted(self) -> list[str]:
        return [i for i, record in self.report.patches.items() if record.state == "pending"]

    def install_hooks(self) -> None:
        started = time.perf_counter()
        import wrapt

        self.report.timings_ms["wrapt_import"] = _ms(started)
        for patch_id in registry_mod.apply_order(self.registry, self.wanted()):
            for trigger in self.registry.patches[patch_id].triggers:
                if trigger not in self._hooked:
                    self._hooked.add(trigger)
                    wrapt.register_post_import_hook(self._on_import, trigger)

    def _on_import(self, module: Any) -> None:
        if not self.active:
            return
        name = module.__name__
        ordered = registry_mod.apply_order(self.registry, self.wanted())
        for patch_id in ordered:
            if name in self.registry.patches[patch_id].triggers:
                self.apply(patch_id, trigger=name)

    # -- applying ----------------------------------------------------------
    def apply(self, patch_id: str, trigger: str = "") -> bool:
        """Apply one patch, all or nothing. True when it is in effect afterwards."""
        record = self.report.patches[patch_id]
        if record.state == "applied":
            return True
        if record.state != "pending" or patch_id in self._applying:
            return False
        spec = self.registry.patches[patch_id]
        self._applying.append(patch_id)
        try:
            reason = self._requirements_met(spec) or self._versions_supported(spec)
            if reason:
                return self._not_applied(patch_id, "skipped", reason)
            return self._run_apply(patch_id, spec, trigger)
        finally:
            self._applying.remove(patch_id)

    def _requirements_met(self, spec: registry_mod.PatchSpec) -> str:
        for required in spec.requires:
            required_record = self.report.patches[required]
            if required_record.state == "pending":
                # Apply the requirement first: importing its trigger fires its hook.
                importlib.import_module(self.registry.patches[required].triggers[0])
                self.apply(required)
            if self.report.patches[required].state != "applied":
                return f"requires {required}, which is {self.report.patches[required].state}"
        return ""

    def _versions_supported(self, spec: registry_mod.PatchSpec) -> str:
        from packaging.specifiers import SpecifierSet

        for distribution, specifier in spec.supports.items():
            if distribution == "torch_npu" and self.settings.target != "npu":
                continue  # the rehearsal runs reference kernels, not torch_npu
            version = self.report.versions.get(distribution) or installed_version(distribution)
            self.report.versions[distribution] = version
            if version is None:
                return f"{distribution} is not installed (needs {specifier})"
            if not SpecifierSet(specifier).contains(version, prereleases=True):
                return f"{distribution} {version} is outside the supported range {specifier}"
        return ""

    def _run_apply(self, patch_id: str, spec: registry_mod.PatchSpec, trigger: str) -> bool:
        from npu_inject.patching import PatchContext, TargetMissing

        started = time.perf_counter()
        context = PatchContext(
            patch_id=patch_id,
            target=self.settings.target,
            options=dict(spec.options),
            declared_targets=spec.targets,
            on_fallback=self._on_fallback,
        )
        self.contexts[patch_id] = context
        try:
            module = importlib.import_module(spec.module)
            self.modules[patch_id] = module
            module.apply(context)
        except TargetMissing as exc:
            context.restore()
            return self._not_applied(patch_id, "failed", f"target missing: {exc}", exc)
        except Exception as exc:  # any failure: restore what the patch changed, record why
            context.restore()
            return self._not_applied(patch_id, "failed", f"{type(exc).__name__}: {exc}", exc)
        self.report.set(
            patch_id, "applied", "", trigger=trigger, apply_ms=_ms(started),
            notes=context.notes, fallbacks=context.fallbacks,
        )
        return True

    def _not_applied(self, patch_id: str, state: str, reason: str,
                     cause: BaseException | None = None) -> bool:
        self.report.set(patch_id, state, reason)
        logger.warning("npu_inject: patch %s %s: %s", patch_id, state, reason)
        if self.settings.strict:
            raise PatchError(
                f"patch {patch_id!r} {state}: {reason} (TORCHTITAN_NPU_STRICT=1 stops the run; "
                f"unset it to continue without the patch, or disable it with TORCHTITAN_NPU_PATCHES=-{patch_id})"
            ) from cause
        return False

    def _on_fallback(self, patch_id: str, reason: str) -> None:
        record = self.report.patches[patch_id]
        if reason not in record.fallbacks:
            record.fallbacks.append(reason)

    # -- reverting ---------------------------------------------------------
    def revert(self, patch_id: str) -> None:
        """Restore everything a patch changed; patches requiring it are reverted first."""
        if self.report.patches[patch_id].state != "applied":
            return
        for other_id, other in self.registry.patches.items():
            if patch_id in other.requires:
                self.revert(other_id)
        module = self.modules.get(patch_id)
        context = self.contexts[patch_id]
        if module is not None and hasattr(module, "revert"):
            module.revert(context)
        context.restore()
        self.report.set(patch_id, "pending", "reverted")

    def revert_all(self) -> None:
        for patch_id in reversed(list(self.report.patches)):
            self.revert(patch_id)

    def deactivate(self) -> None:
        """Revert every patch and make the import hooks inert (tests)."""
        self.revert_all()
        self.active = False

    # -- report ------------------------------------------------------------
    def write_report(self, directory: str | None = None) -> str | None:
        directory = directory or self.dump_dir or self.settings.report_dir
        if directory is None:
            return None
        return self.report.write(directory)

    def set_dump_folder(self, dump_folder: str) -> None:
        self.dump_dir = os.path.join(dump_folder, "npu_inject")


_RUNTIME: Runtime | None = None


def current() -> Runtime | None:
    return _RUNTIME


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000.0, 3)


def _import_backend(settings: settings_mod.Settings, report: Report) -> None:
    backend = TARGET_BACKEND_MODULE[settings.target]
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
    report.timings_ms[f"{backend}_import"] = _ms(started)
    report.versions[backend] = getattr(module, "__version__", None) or installed_version(backend)
    if getattr(module, "__simulated__", False):
        report.versions[f"{backend}_simulated"] = "yes"


def activate(environ: dict | None = None, *, install_hooks: bool = True) -> Runtime | None:
    """Validate everything, then hook the enabled patches' trigger modules.

    Raises ConfigError before touching anything when the configuration is bad.
    """
    global _RUNTIME
    if _RUNTIME is not None and _RUNTIME.active:
        return _RUNTIME
    started = time.perf_counter()
    settings = settings_mod.load(environ)
    if not settings.enabled:
        return None
    registry = registry_mod.load(settings.registry_path)
    enabled = registry_mod.select(registry, settings.patches)
    runtime = Runtime(settings, registry, enabled)
    _import_backend(settings, runtime.report)
    runtime.report.versions.setdefault("torchtitan", installed_version("torchtitan"))
    runtime.report.versions.setdefault("torch", installed_version("torch"))
    _RUNTIME = runtime
    if install_hooks:
        runtime.install_hooks()
        atexit.register(_write_report_at_exit, runtime)
    runtime.report.timings_ms["activate"] = _ms(started)
    return runtime


def deactivate() -> None:
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.deactivate()
    _RUNTIME = None


def _write_report_at_exit(runtime: Runtime) -> None:
    if runtime.active:
        runtime.write_report()


def log_summary(runtime: Runtime, emit: Callable[[str], None] | None = None) -> str:
    line = runtime.report.summary_line()
    (emit or logger.info)(line)
    return line

