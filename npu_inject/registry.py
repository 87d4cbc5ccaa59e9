"""The patch catalog: ``registry.json``, user overrides, third-party entries.

The catalog is data, readable without importing any patch code. Loading it
validates every field and names the file, patch id and key at fault.
Stdlib only, plus :mod:`packaging` for version specifiers (imported lazily).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from npu_inject.errors import ConfigError

PACKAGED_REGISTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "registry.json")
ENTRY_POINT_GROUP = "npu_inject.registry"
SCHEMA_VERSION = 1
# Distributions whose versions a patch may constrain.
VERSIONED_DISTRIBUTIONS = ("torchtitan", "torch", "torch_npu")

# key -> (python type(s), required in a full entry, description for errors)
_ENTRY_FIELDS: dict[str, tuple[type | tuple[type, ...], bool, str]] = {
    "module": (str, True, "dotted module path of the patch code"),
    "triggers": (list, True, "list of module names whose import applies the patch"),
    "targets": (list, True, "list of 'module:qualname' strings the patch changes"),
    # Optional where the document's "defaults" give it: an entry's own specifiers override those.
    "supports": (dict, False, "mapping of distribution -> PEP 440 specifier"),
    "requires": (list, False, "list of patch ids applied first"),
    "default": (bool, True, "true or false: enabled unless the selection says otherwise"),
    "options": (dict, False, "mapping of option name -> default value"),
    "option_rules": (dict, False, "mapping of option name -> {'min': n, 'max': n, 'choices': [...]}"),
    "runs_on": (list, False, "list of runtime targets, 'npu' and/or 'cpu', the patch applies to"),
    "description": (str, True, "one-line description"),
}
# What a user registry may change in an existing entry (toggles and options).
_OVERRIDABLE = ("default", "options", "supports", "description")
_TARGET_KINDS = ("npu", "cpu")
_RULE_KEYS = ("min", "max", "choices")
# What a document's top-level "defaults" may give every full entry it holds.
_DEFAULTABLE = ("supports",)
# Ids that were patches once: selecting them names what replaced them instead of "unknown".
RETIRED_IDS = {
    "rank_sync": "cross-rank agreement and per-rank reports are runtime services now, always on",
    "checkpoint_io": "it was split into checkpoint_staging (pinned staging) and checkpoint_publish "
                     "(atomic publish, completeness checks); select those",
}


def split_target(target: str) -> tuple[str, str]:
    """``'package.module:Qual.name'`` -> (module, qualname); the one parser of target strings."""
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"target {target!r} must look like 'package.module:Qual.name'")
    return module_name, qualname


def installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class PatchSpec:
    """One catalog entry, validated."""

    id: str
    module: str
    triggers: tuple[str, ...]
    targets: tuple[str, ...]
    supports: Mapping[str, str]
    requires: tuple[str, ...]
    default: bool
    options: Mapping[str, Any]
    option_rules: Mapping[str, Mapping[str, Any]]
    runs_on: tuple[str, ...]
    description: str
    source: str  # file or entry point the entry came from

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "module": self.module,
            "triggers": list(self.triggers),
            "targets": list(self.targets),
            "supports": dict(self.supports),
            "requires": list(self.requires),
            "default": self.default,
            "options": dict(self.options),
            "option_rules": {name: dict(rule) for name, rule in self.option_rules.items()},
            "runs_on": list(self.runs_on),
            "description": self.description,
            "source": self.source,
        }


@dataclass
class Registry:
    patches: dict[str, PatchSpec] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def get(self, patch_id: str) -> PatchSpec:
        try:
            return self.patches[patch_id]
        except KeyError:
            raise ConfigError(unknown_id_message(patch_id, self.patches, "patch")) from None


def unknown_id_message(name: str, known: Mapping[str, Any] | list[str], what: str) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown {what} {name!r}{hint} (known: {', '.join(sorted(known))})"


def read_json(path: str) -> Any:
    """Parse a JSON file; syntax errors name the file, line and column."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read registry file: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}"
        ) from None


def _check_type(where: str, key: str, value: Any) -> None:
    expected, _, meaning = _ENTRY_FIELDS[key]
    if not isinstance(value, expected):
        raise ConfigError(f"{where}: key {key!r} must be {meaning}, got {type(value).__name__}")
    if key in ("triggers", "targets", "requires", "runs_on"):
        for item in value:
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{where}: every item of {key!r} must be a non-empty string, got {item!r}")
    if key == "targets":
        for item in value:
            try:
                split_target(item)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
    if key == "runs_on":
        for item in value:
            if item not in _TARGET_KINDS:
                raise ConfigError(f"{where}: 'runs_on' item {item!r} must be one of {', '.join(_TARGET_KINDS)}")
    if key == "supports":
        _check_supports(where, value)
    if key == "option_rules":
        for name, rule in value.items():
            if not isinstance(rule, dict) or not rule or set(rule) - set(_RULE_KEYS):
                raise ConfigError(
                    f"{where}: option_rules[{name!r}] must be an object with one or more of "
                    f"{', '.join(map(repr, _RULE_KEYS))}, got {rule!r}"
                )


def check_options(where: str, options: Mapping[str, Any], rules: Mapping[str, Mapping[str, Any]]) -> None:
    """Every option value within its rule (min/max for numbers, choices for anything)."""
    for name, rule in rules.items():
        if name not in options:
            raise ConfigError(f"{where}: option_rules names {name!r}, which is not an option "
                              f"(options: {', '.join(sorted(options)) or '(none)'})")
        value = options[name]
        choices = rule.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{where}: option {name!r}={value!r} must be one of "
                              f"{', '.join(map(repr, choices))}")
        bounded = "min" in rule or "max" in rule
        if bounded and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{where}: option {name!r} must be a number, got {value!r}")
        if "min" in rule and value < rule["min"]:
            raise ConfigError(f"{where}: option {name!r}={value!r} must be >= {rule['min']}")
        if "max" in rule and value > rule["max"]:
            raise ConfigError(f"{where}: option {name!r}={value!r} must be <= {rule['max']}")


def _check_supports(where: str, supports: Mapping[str, Any]) -> None:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    for dist, spec in supports.items():
        if dist not in VERSIONED_DISTRIBUTIONS:
            raise ConfigError(
                f"{where}: 'supports' names {dist!r}; allowed: {', '.join(VERSIONED_DISTRIBUTIONS)}"
            )
        if not isinstance(spec, str):
            raise ConfigError(f"{where}: supports[{dist!r}] must be a PEP 440 specifier string")
        try:
            SpecifierSet(spec)
        except InvalidSpecifier:
            raise ConfigError(
                f"{where}: supports[{dist!r}]={spec!r} is not a PEP 440 specifier (e.g. '>=0.3,<0.4')"
            ) from None


def _full_entry(where: str, patch_id: str, raw: Any, source: str,
                defaults: Mapping[str, Any] = MappingProxyType({})) -> PatchSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: entry must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_ENTRY_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_ENTRY_FIELDS)}")
    missing = [key for key, (_, required, _) in _ENTRY_FIELDS.items() if required and key not in raw]
    if "supports" not in raw and "supports" not in defaults:
        missing.append("supports")
    if missing:
        defaultable = [key for key in missing if key in _DEFAULTABLE]
        hint = f" ({', '.join(defaultable)} may instead be given once in the document's 'defaults')" if defaultable else ""
        raise ConfigError(f"{where}: missing key(s) {', '.join(map(repr, missing))}{hint}")
    for key, value in raw.items():
        _check_type(where, key, value)
    check_options(where, raw.get("options", {}), raw.get("option_rules", {}))
    return PatchSpec(
        id=patch_id,
        module=raw["module"],
        triggers=tuple(raw["triggers"]),
        targets=tuple(raw["targets"]),
        supports=MappingProxyType({**defaults.get("supports", {}), **raw.get("supports", {})}),
        requires=tuple(raw.get("requires", ())),
        default=raw["default"],
        options=MappingProxyType(dict(raw.get("options", {}))),
        option_rules=MappingProxyType(dict(raw.get("option_rules", {}))),
        runs_on=tuple(raw.get("runs_on", _TARGET_KINDS)),
        description=raw["description"],
        source=source,
    )


def _override(where: str, base: PatchSpec, raw: Any, source: str) -> PatchSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: entry must be a JSON object, got {type(raw).__name__}")
    not_allowed = sorted(set(raw) - set(_OVERRIDABLE))
    if not_allowed:
        raise ConfigError(
            f"{where}: key(s) {', '.join(map(repr, not_allowed))} cannot be overridden for "
            f"existing patch {base.id!r}; allowed: {', '.join(_OVERRIDABLE)}"
        )
    for key, value in raw.items():
        _check_type(where, key, value)
    options = dict(base.options)
    for name, value in raw.get("options", {}).items():
        if name not in options:
            raise ConfigError(
                f"{where}: unknown option {name!r} for patch {base.id!r}; "
                f"allowed: {', '.join(sorted(options)) or '(none)'}"
            )
        if options[name] is not None and type(value) is not type(options[name]):
            raise ConfigError(
                f"{where}: option {name!r} must be {type(options[name]).__name__} "
                f"like its default {options[name]!r}, got {value!r}"
            )
        options[name] = value
    check_options(where, options, base.option_rules)
    return PatchSpec(
        id=base.id,
        module=base.module,
        triggers=base.triggers,
        targets=base.targets,
        supports=MappingProxyType(dict(raw.get("supports", base.supports))),
        requires=base.requires,
        default=raw.get("default", base.default),
        options=MappingProxyType(options),
        option_rules=base.option_rules,
        runs_on=base.runs_on,
        description=raw.get("description", base.description),
        source=f"{base.source} + {source}",
    )


def _read_defaults(source: str, defaults: Any) -> Mapping[str, Any]:
    """A document's "defaults": fields every new entry of that document takes unless it gives its own."""
    where = f"{source}: 'defaults'"
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where} must be an object, got {type(defaults).__name__}")
    not_allowed = sorted(set(defaults) - set(_DEFAULTABLE))
    if not_allowed:
        raise ConfigError(f"{where}: key(s) {', '.join(map(repr, not_allowed))} cannot have a default; "
                          f"allowed: {', '.join(_DEFAULTABLE)}")
    for key, value in defaults.items():
        _check_type(where, key, value)
    return defaults


def merge_document(registry: Registry, document: Any, source: str) -> None:
    """Merge one registry document: new ids need full entries, known ids take overrides."""
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: top level must be a JSON object with a 'patches' key")
    unknown = sorted(set(document) - {"schema", "defaults", "patches"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
                          "allowed: 'schema', 'defaults', 'patches'")
    schema = document.get("schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise ConfigError(f"{source}: 'schema' is {schema!r}; this runtime reads schema {SCHEMA_VERSION}")
    patches = document.get("patches")
    if not isinstance(patches, dict):
        raise ConfigError(f"{source}: 'patches' must be an object mapping patch id -> entry")
    defaults = _read_defaults(source, document.get("defaults", {}))
    for patch_id, raw in patches.items():
        where = f"{source}: patches[{patch_id!r}]"
        if patch_id in registry.patches:
            registry.patches[patch_id] = _override(where, registry.patches[patch_id], raw, source)
        else:
            registry.patches[patch_id] = _full_entry(where, patch_id, raw, source, defaults)
    registry.sources.append(source)


def _entry_point_documents() -> list[tuple[str, Any]]:
    """Registry fragments published by other distributions (group ``npu_inject.registry``).

    Each entry point loads to a dict in registry.json's format, or to the path of such a file.
    """
    from importlib.metadata import distributions, entry_points

    # entry_points() parses every distribution's entry points (~10 ms with ~100 installed);
    # reading their entry_points.txt for our group's section header costs 40% of that, and
    # most environments publish none.
    header = f"[{ENTRY_POINT_GROUP}]"
    if not any(header in (dist.read_text("entry_points.txt") or "") for dist in distributions()):
        return []
    documents = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        source = f"entry point {entry_point.name} = {entry_point.value}"
        loaded = entry_point.load()
        if isinstance(loaded, (str, os.PathLike)):
            documents.append((f"{loaded} ({source})", read_json(os.fspath(loaded))))
        elif isinstance(loaded, dict):
            documents.append((source, loaded))
        else:
            raise ConfigError(f"{source}: must load to a registry dict or a JSON file path, got {type(loaded).__name__}")
    return documents


def validate_graph(registry: Registry) -> None:
    """Every requirement exists and there is no cycle."""
    for spec in registry.patches.values():
        for required in spec.requires:
            if required not in registry.patches:
                raise ConfigError(
                    f"{spec.source}: patch {spec.id!r} requires {unknown_id_message(required, registry.patches, 'patch')}"
                )
    visiting: list[str] = []
    done: set[str] = set()

    def visit(patch_id: str) -> None:
        if patch_id in done:
            return
        if patch_id in visiting:
            cycle = visiting[visiting.index(patch_id):] + [patch_id]
            raise ConfigError(f"requirement cycle between patches: {' -> '.join(cycle)}")
        visiting.append(patch_id)
        for required in registry.patches[patch_id].requires:
            visit(required)
        visiting.pop()
        done.add(patch_id)

    for patch_id in registry.patches:
        visit(patch_id)


def load(user_path: str | None = None, *, entry_points: bool = True) -> Registry:
    """The packaged catalog, then third-party entry points, then the user's file."""
    registry = Registry()
    merge_document(registry, read_json(PACKAGED_REGISTRY), PACKAGED_REGISTRY)
    if entry_points:
        for source, document in _entry_point_documents():
            merge_document(registry, document, source)
    if user_path:
        merge_document(registry, read_json(user_path), user_path)
    validate_graph(registry)
    return registry


def select(registry: Registry, selection: str, variable: str = "TORCHTITAN_NPU_PATCHES") -> dict[str, bool]:
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
            if name in RETIRED_IDS:
                raise ConfigError(f"{variable}: {name!r} is no longer a patch: {RETIRED_IDS[name]}")
            raise ConfigError(f"{variable}: {unknown_id_message(name, registry.patches, 'patch id')}")
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


def initial_state(spec: PatchSpec, enabled: Mapping[str, bool], target: str | None) -> tuple[str, str]:
    """(state, reason) of a patch before its trigger is imported: 'disabled' or 'pending'.

    ``enabled`` is :func:`select`'s result for the whole registry.
    """
    if not enabled[spec.id]:
        off = [required for required in spec.requires if not enabled[required]]
        if off:
            return "disabled", f"off: requires {', '.join(off)}, which the selection turned off"
        return "disabled", "off by selection"
    if target is not None and target not in spec.runs_on:
        return "disabled", f"runs only on {', '.join(spec.runs_on)}"
    return "pending", f"waiting for import of {' or '.join(spec.triggers)}"


def version_problem(spec: PatchSpec, target: str | None, version_of=installed_version) -> str:
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


def apply_order(registry: Registry, patch_ids: list[str]) -> list[str]:
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
