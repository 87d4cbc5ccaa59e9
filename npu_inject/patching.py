"""What a patch uses to change torchtitan: recorded, reversible edits.

Every change a patch makes goes through a :class:`PatchContext`, which keeps
the exact original (the raw class ``__dict__`` entry for class attributes, so
staticmethods, classmethods and properties come back unchanged). Reverting
restores the originals in reverse order; the runtime reverts automatically when
``apply`` raises, which makes applying all or nothing.

What a patch installs is a plain Python function (``functools.wraps`` of the
original), not a proxy object: torch.compile's dynamo traces plain functions and
closures without a graph break, while it cannot trace through wrapt's
``FunctionWrapper``. wrapt stays where it is the right tool: the import hooks.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from npu_inject.module_facts import split_target

logger = logging.getLogger("npu_inject")

_MISSING = object()


@dataclass
class _Change:
    owner: Any
    attribute: str
    original: Any  # raw value, or _MISSING if the attribute did not exist on owner
    target: str


class TargetMissing(LookupError):
    """A ``module:qualname`` target does not exist in the installed torchtitan."""


def resolve_owner(target: str) -> tuple[Any, str]:
    """(object holding the attribute, attribute name) for ``module:Qual.name``."""
    module_name, qualname = split_target(target)
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetMissing(f"{target}: module {module_name!r} cannot be imported ({exc})") from exc
    *path, attribute = qualname.split(".")
    for part in path:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise TargetMissing(f"{target}: {part!r} not found") from None
    return owner, attribute


def _raw_get(owner: Any, attribute: str) -> Any:
    if inspect.isclass(owner):
        for klass in owner.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute] if klass is owner else _Inherited(vars(klass)[attribute])
        return _MISSING
    return getattr(owner, attribute, _MISSING)


class _Inherited:
    """Marks a class attribute found on a base class: reverting deletes the override."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _method_original(value: Any) -> Any:
    """A class attribute ``value`` as a function of ``(self, ...)``. A wrapped method (wrapt's FunctionWrapper,
    which passes for a function) is bound to the instance first: called unbound, its wrapper would see no instance."""
    if type(value) is types.FunctionType or not hasattr(value, "__get__"):
        return value

    @functools.wraps(value)
    def bound_call(instance: Any, *args: Any, **kwargs: Any) -> Any:
        return value.__get__(instance, type(instance))(*args, **kwargs)

    return bound_call


class _Liveness:
    """Whether the changes of one application of a patch still stand (false once it was restored)."""

    alive = True


def _forwarding(original: Callable[..., Any], wrapper: Callable[..., Any], liveness: _Liveness) -> Callable[..., Any]:
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        # A patch restored while a later patch's wrapper still held this one (patches reverted other than newest
        # first) may be put back by that patch's restore: it then forwards, doing nothing of its own.
        if not liveness.alive:
            return original(*args, **kwargs)
        return wrapper(original, *args, **kwargs)

    return patched


@dataclass
class PatchContext:
    """Handed to a patch's ``apply`` (and optional ``revert``); records every change it makes."""

    patch_id: str
    device_kind: str  # "npu" or "cpu" (the run's TORCHTITAN_NPU target)
    options: Mapping[str, Any]
    declared_targets: tuple[str, ...] = ()  # the patch module's TARGETS, "module:qualname" each
    changes: list[_Change] = field(default_factory=list)
    changed_otherwise: list[str] = field(default_factory=list)  # declared targets changed without replace()
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    agreements: list[tuple[str, Any, Callable[[Any], None]]] = field(default_factory=list)
    liveness: _Liveness = field(default_factory=_Liveness)

    @property
    def rehearsal(self) -> bool:
        return self.device_kind == "cpu"

    @property
    def dispatch_key(self) -> str:
        """The dispatch key the run's tensors dispatch to (for torch.library kernels)."""
        return {"cpu": "CPU", "npu": "PrivateUse1"}[self.device_kind]

    def replace(self, target: str, value: Any) -> Any:
        """Set ``target`` to ``value``; returns the previous (raw) value.

        ``target`` is one of the patch's declared targets, named by its qualname alone
        (``"OptimizersContainer.__init__"``) when that names one of them: the module is
        stated once, in the patch module's TARGETS. Full ``module:qualname`` strings work too.
        """
        target = self.declared(target)
        owner, attribute = resolve_owner(target)
        raw = _raw_get(owner, attribute)
        if raw is _MISSING:
            raise TargetMissing(f"{target}: attribute {attribute!r} not found")
        original = _MISSING if isinstance(raw, _Inherited) else raw
        self.changes.append(_Change(owner, attribute, original, target))
        setattr(owner, attribute, value)
        return raw.value if isinstance(raw, _Inherited) else raw

    def wrap(self, target: str, wrapper: Callable[..., Any]) -> Any:
        """Install a function that calls ``wrapper(original, *args, **kwargs)`` in place of ``target``.

        For a method, ``args[0]`` is the instance (or the class for a classmethod), so a
        wrapper declares the original's parameters after ``original`` and Python binds them.
        Returns what was installed.
        """
        target = self.declared(target)
        owner, attribute = resolve_owner(target)
        raw = _raw_get(owner, attribute)
        if raw is _MISSING:
            raise TargetMissing(f"{target}: attribute {attribute!r} not found")
        value = raw.value if isinstance(raw, _Inherited) else raw
        if isinstance(value, (staticmethod, classmethod)):
            installed = type(value)(_forwarding(value.__func__, wrapper, self.liveness))
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
            installed = _forwarding(_method_original(value) if inspect.isclass(owner) else value, wrapper,
                                    self.liveness)
        else:
            raise TypeError(
                f"{target} is a {type(value).__name__}, not a function or method; "
                "use PatchContext.replace for other attributes"
            )
        self.replace(target, installed)
        return installed

    def wrap_overrides(self, target: str, wrapper: Callable[..., Any]) -> None:
        """:meth:`wrap` a method, and the same method wherever a subclass overrides it, now or later.

        torchtitan's trainers for other model kinds (torchft's FaultTolerantTrainer, flux's, the graph
        trainer) override ``Trainer.train_step`` or ``init_distributed`` without calling the base method: a
        wrapper on the base class alone would silently do nothing for them. Overrides that exist are wrapped
        now; a subclass defined later is wrapped as it is created (``__init_subclass__`` on the class). A
        wrapper that can be reached twice (an override calling ``super()``) must tolerate nesting.
        """
        self.wrap(target, wrapper)
        full_target = self.declared(target)
        owner, attribute = resolve_owner(full_target)
        if not inspect.isclass(owner):
            raise TypeError(f"{full_target}: wrap_overrides needs a method of a class, {owner!r} is not one")

        liveness = self.liveness

        def wrap_class(cls: type) -> None:
            value = vars(cls).get(attribute)
            if liveness.alive and isinstance(value, types.FunctionType):
                self.changes.append(_Change(cls, attribute, value, f"{cls.__module__}:{cls.__qualname__}.{attribute}"))
                setattr(cls, attribute, _forwarding(_method_original(value), wrapper, liveness))

        pending = list(owner.__subclasses__())
        while pending:
            cls = pending.pop()
            wrap_class(cls)
            pending.extend(cls.__subclasses__())
        previous = vars(owner).get("__init_subclass__")

        def init_subclass(cls, **kwargs) -> None:
            if previous is not None:
                previous.__get__(None, cls)(**kwargs)
            else:
                super(owner, cls).__init_subclass__(**kwargs)
            wrap_class(cls)

        self.changes.append(_Change(owner, "__init_subclass__", _MISSING if previous is None else previous,
                                    f"{full_target} (subclasses)"))
        owner.__init_subclass__ = classmethod(init_subclass)

    def serve_modules(self, names: Iterable[str], fill: Callable[[types.ModuleType], None], *,
                      missing: Callable[[str, str], Any], packages: Iterable[str] = (),
                      origin: str | None = None) -> None:
        """Serve the modules ``names`` from this patch, ahead of every installed one, until revert.

        For modules whose real import cannot work here (they need triton, or fla's CUDA kernels).
        Each is created when first imported and handed to ``fill(module)``; an attribute it lacks
        is ``missing(module_name, attribute)`` (return a value or raise). ``packages`` are served as
        packages whose submodules come from this finder only. Reverting removes the finder and the
        served modules from ``sys.modules``. Each name is a declared ``module:*`` target, or a
        submodule of a declared package (``fla:*`` serves ``fla.ops`` too).
        """
        names = tuple(names)
        for name in names:
            self.changed_otherwise.append(self._served_target(name))
        finder = _ServingFinder(names, frozenset(packages), _ServingLoader(fill, missing),
                                origin or f"npu_inject patch {self.patch_id}")
        sys.meta_path.insert(0, finder)

        def remove() -> None:
            sys.meta_path.remove(finder)
            for name in finder.names:
                if getattr(getattr(sys.modules.get(name), "__spec__", None), "loader", None) is finder.loader:
                    del sys.modules[name]

        self.add_cleanup(remove)

    def _served_target(self, module_name: str) -> str:
        parts = module_name.split(".")
        for length in range(len(parts), 0, -1):
            target = ".".join(parts[:length]) + ":*"
            if target in self.declared_targets:
                return target
        raise ValueError(f"patch {self.patch_id} serves module {module_name!r}, which no 'module:*' of its "
                         f"TARGETS covers ({', '.join(self.declared_targets)})")

    def changed(self, target: str) -> None:
        """Record that a declared target was changed by means the context does not undo itself (an
        op's kernel registered with torch.library, say): its revert is the patch's own cleanup."""
        self.changed_otherwise.append(self.declared(target))

    def touched(self) -> set[str]:
        """The declared targets this context changed (tests: every unconditional one must be)."""
        return {change.target for change in self.changes} | set(self.changed_otherwise)

    def add_cleanup(self, cleanup: Callable[[], None]) -> None:
        """Run on revert, for state that is not an attribute (registries, env vars)."""
        self.cleanups.append(cleanup)

    def fallback(self, reason: str) -> None:
        """Record (once per reason) that a slower or reference path is taken, and why."""
        _record_fallback(self, reason)

    def note(self, message: str) -> None:
        """A fact for the report (e.g. which optimizer implementation was picked)."""
        _record_note(self, message)

    def agree_with_rank0(self, name: str, proposal: Any, use: Callable[[Any], None]) -> None:
        """One value for the whole job: every rank proposes, rank 0's proposal is used everywhere.

        The runtime exchanges proposals in the all-gather that checks the ranks applied the same
        patches (npu_inject.rank_agreement, when Trainer.init_distributed returns), then calls
        ``use(rank 0's proposal)`` on every rank; without a multi-rank process group, with this
        rank's own. So register before Trainer.init_distributed returns; ``proposal`` must pickle.
        """
        self.agreements.append((name, proposal, use))

    def restore(self) -> None:
        """Undo every recorded change, newest first; leaves the context reusable."""
        errors = []
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception as exc:  # keep restoring the rest; report all failures together
                errors.append(f"cleanup {cleanup!r}: {exc!r}")
        for change in reversed(self.changes):
            if change.original is _MISSING:
                if change.attribute in vars(change.owner):
                    delattr(change.owner, change.attribute)
            else:
                setattr(change.owner, change.attribute, change.original)
        self.changes.clear()
        self.changed_otherwise.clear()
        self.cleanups.clear()
        self.agreements.clear()
        self.liveness.alive = False
        self.liveness = _Liveness()  # the next application's changes
        if errors:
            raise RuntimeError(f"patch {self.patch_id}: restoring failed: {'; '.join(errors)}")

    def declared(self, name: str) -> str:
        """The declared ``module:qualname`` target ``name`` stands for (a qualname, or the full target).

        Keeps TARGETS honest: a patch may only touch what its module declares.
        """
        if ":" in name:
            matches = [name] if name in self.declared_targets else []
        else:
            matches = self.targets_named(name)
        if len(matches) == 1:
            return matches[0]
        problem = "names more than one" if matches else "is not one"
        raise ValueError(
            f"patch {self.patch_id} changes {name!r}, which {problem} of the TARGETS its module "
            f"declares ({', '.join(self.declared_targets)}); name a declared 'module:qualname'"
        )

    def targets_named(self, qualname: str) -> list[str]:
        """Every declared target whose qualname is ``qualname`` (one per module that defines it)."""
        return [target for target in self.declared_targets if split_target(target)[1] == qualname]


class _ServedModule(types.ModuleType):
    """A module served by :meth:`PatchContext.serve_modules`; what it lacks, the patch says."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__spec__.loader.missing(self.__name__, name)


class _ServingLoader(importlib.abc.Loader):
    def __init__(self, fill: Callable[[types.ModuleType], None], missing: Callable[[str, str], Any]) -> None:
        self.fill = fill
        self.missing = missing

    def create_module(self, spec):
        return _ServedModule(spec.name)

    def exec_module(self, module):
        self.fill(module)


class _ServingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: tuple[str, ...], packages: frozenset[str], loader: _ServingLoader,
                 origin: str) -> None:
        self.names, self.packages, self.loader, self.origin = names, packages, loader, origin

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        is_package = fullname in self.packages
        spec = importlib.machinery.ModuleSpec(fullname, self.loader, origin=self.origin, is_package=is_package)
        if is_package:
            spec.submodule_search_locations = []  # submodules come from this finder only
        return spec


# Patches record fallbacks and notes from inside compiled blocks too (moe_dispatch's grouped
# matmul, attention). Traced, the membership test became a guard on the list, which the first
# trace's own append broke: every block recompiled once, and again whenever any patch recorded
# something. Marked as torch.compiler.assume_constant_result does (the attribute alone: this
# module does not import torch), dynamo runs them once while tracing and guards on nothing inside.
def _record_fallback(context: PatchContext, reason: str) -> bool:
    if reason not in context.fallbacks:
        context.fallbacks.append(reason)
        logger.warning("npu_inject: patch %s falls back: %s", context.patch_id, reason)
    return True


def _record_note(context: PatchContext, message: str) -> bool:
    if message not in context.notes:
        context.notes.append(message)
    return True


_record_fallback._dynamo_marked_constant = True  # type: ignore[attr-defined]
_record_note._dynamo_marked_constant = True  # type: ignore[attr-defined]
