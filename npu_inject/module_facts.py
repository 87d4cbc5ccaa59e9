"""What a patch module says about itself, read from its source without importing it.

A patch module is the one home of two facts: what it is for (its docstring, whose first
line is the description ``npu-inject list`` shows) and the targets it rewrites (``TARGETS``,
a literal near its top). The catalog, ``doctor`` and the docs read both here with
:mod:`ast`, so none of them imports patch code (or torch, or torchtitan); the runtime reads
``TARGETS`` from the module it imports to apply the patch, through :func:`parse_targets`.

``TARGETS`` is a tuple, in the order the patch changes them, of ``"module:qualname"``
strings (``"module:*"``: the whole module is served), or ``("module:qualname", "when ...")``
pairs for a target changed only under a condition (tests check that every unconditional
target is touched when the patch applies).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass

from npu_inject.errors import ConfigError

TARGETS_NAME = "TARGETS"


def split_target(target: str) -> tuple[str, str]:
    """``'package.module:Qual.name'`` -> (module, qualname); the one parser of target strings."""
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"target {target!r} must look like 'package.module:Qual.name'")
    return module_name, qualname


@dataclass(frozen=True)
class Target:
    name: str  # "module:qualname" ("module:*" for a whole module)
    condition: str = ""  # "" when the patch always changes it; else when it does


@dataclass(frozen=True)
class ModuleFacts:
    path: str
    docstring: str
    targets: tuple[Target, ...]

    @property
    def description(self) -> str:
        """The docstring's first line: the patch's one hand-written description."""
        return self.docstring.splitlines()[0].strip() if self.docstring else ""

    @property
    def details(self) -> str:
        """The docstring after its first line: how the patch works."""
        return "\n".join(self.docstring.splitlines()[1:]).strip()


def parse_targets(value: object, where: str) -> tuple[Target, ...]:
    """A module's ``TARGETS`` value as Targets; errors name ``where`` and the valid forms."""
    form = ("a tuple of 'module:qualname' strings or ('module:qualname', 'when ...') pairs, "
            "in the order the patch changes them")
    if not isinstance(value, (tuple, list)) or not value:
        raise ConfigError(f"{where}: {TARGETS_NAME} must be {form}, got {value!r}")
    targets = []
    for item in value:
        if isinstance(item, str):
            name, condition = item, ""
        elif (isinstance(item, (tuple, list)) and len(item) == 2
              and all(isinstance(part, str) and part for part in item)):
            name, condition = item
        else:
            raise ConfigError(f"{where}: {TARGETS_NAME} item {item!r} is not valid; {TARGETS_NAME} must be {form}")
        try:
            split_target(name)
        except ValueError as exc:
            raise ConfigError(f"{where}: {TARGETS_NAME}: {exc}") from None
        targets.append(Target(name, condition))
    names = [target.name for target in targets]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"{where}: {TARGETS_NAME} names {', '.join(repeated)} more than once")
    return tuple(targets)


def declared_names(module: object) -> tuple[str, ...]:
    """The ``module:qualname`` names of an imported patch module's TARGETS (the runtime's view)."""
    where = getattr(module, "__file__", None) or getattr(module, "__name__", repr(module))
    return tuple(target.name for target in parse_targets(getattr(module, TARGETS_NAME, None), where))


def module_source(module_name: str) -> str | None:
    """Path of an installed module's source, found without importing any package.

    ``find_spec`` of a top-level name imports nothing; with the runtime enabled it
    does not activate it either (the bootstrap activates on execution only).
    """
    top, *rest = module_name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        return None
    if not rest:
        return spec.origin if os.path.isfile(spec.origin) and spec.origin.endswith(".py") else None
    base = os.path.join(os.path.dirname(spec.origin), *rest) if rest else os.path.dirname(spec.origin)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def read(module_name: str) -> ModuleFacts:
    """The docstring and TARGETS of the patch module ``module_name``, from its source."""
    path = module_source(module_name)
    if path is None:
        raise ConfigError(f"patch module {module_name!r} not found (no source file on sys.path)")
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    docstring = ast.get_docstring(tree) or ""
    if not docstring:
        raise ConfigError(f"{path}: a patch module starts with a docstring whose first line says what it does")
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == TARGETS_NAME):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise ConfigError(f"{path}:{node.lineno}: {TARGETS_NAME} must be a literal (strings and "
                                  "pairs of strings), readable without importing the module") from None
            return ModuleFacts(path, docstring, parse_targets(value, f"{path}:{node.lineno}"))
    raise ConfigError(f"{path}: no module-level {TARGETS_NAME} = (...): a patch module states the targets it "
                      "changes near its top")
