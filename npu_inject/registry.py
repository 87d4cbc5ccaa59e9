"""The patch catalog: ``registry.json``, user overrides, third-party entries.

The catalog is data, readable without importing any patch code: which module triggers a
patch, the versions it supports, what it requires, its default and options. A patch's
description and targets are its module's own (its docstring and ``TARGETS``, read by
:mod:`npu_inject.module_facts` from source). An entry states only what differs from
:class:`PatchSpec`'s defaults; :class:`PatchSpec`'s fields are the one list of entry keys:
they drive parsing, the user overlay, JSON output and the docs' table. Loading validates
every key and names the file, patch id and key at fault.
Stdlib only, plus :mod:`packaging` for version specifiers (imported lazily).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from npu_inject import module_facts
from npu_inject.errors import ConfigError
from npu_inject.module_facts import split_target  # noqa: F401 (the one parser of target strings)

PACKAGED_REGISTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "registry.json")
ENTRY_POINT_GROUP = "npu_inject.registry"
SCHEMA_VERSION = 2
# Schema 1 documents (npu-inject 0.2) still load: their entries only carried keys that moved or that now
# have defaults, and the two that moved into the patch module are refused with what to do instead.
READABLE_SCHEMAS = (1, SCHEMA_VERSION)
MOVED_KEYS = {
    "targets": "a patch module states the targets it changes itself, as TARGETS = (...) near its top",
    "description": "a patch's description is the first line of its module's docstring",
}
# Distributions whose versions a patch may constrain.
VERSIONED_DISTRIBUTIONS = ("torchtitan", "torch", "torch_npu")
PATCH_PACKAGE = "npu_inject.patches"  # where an entry's module lives unless it says otherwise
TARGET_KINDS = ("npu", "cpu")
_RULE_KEYS = ("min", "max", "choices")
# Ids that were patches once: selecting them names what replaced them instead of "unknown".
RETIRED_IDS = {
    "rank_sync": "cross-rank agreement and per-rank reports are runtime services now, always on",
    "checkpoint_io": "it was split into checkpoint_staging (pinned staging) and checkpoint_publish "
                     "(atomic publish, completeness checks); select those",
}


def _key(json_type: type | tuple[type, ...], meaning: str, *, overridable: bool = False, **default: Any):
    """A registry entry key: its JSON type, what it means (errors, docs), whether a user registry
    may change it in an existing entry, and its default (none: required)."""
    metadata = {"json_type": json_type, "meaning": meaning, "overridable": overridable}
    return field(metadata=metadata, **default)


@dataclass(frozen=True)
class PatchSpec:
    """One catalog entry, validated. The fields declared with :func:`_key` are the entry's keys."""

    id: str
    source: str  # the file or entry point the entry came from (+ the files that changed it)
    defined_in: str  # the file or entry point that defined the entry (its triggers, module, requires)
    triggers: tuple[str, ...] = _key(list, "list of module names whose import applies the patch")
    module: str = _key(str, f"dotted path of the patch module (default: {PATCH_PACKAGE}.<id>)", default="")
    supports: Mapping[str, str] = _key(
        (dict, str), "version ranges, merged over the document's 'defaults': a mapping of distribution "
        "-> PEP 440 specifier, or the name of a range in 'ranges'", overridable=True,
        default_factory=lambda: MappingProxyType({}))
    requires: tuple[str, ...] = _key(list, "list of patch ids applied first", default=())
    default: bool = _key(bool, "true or false: enabled unless the selection says otherwise",
                         overridable=True, default=True)
    options: Mapping[str, Any] = _key(dict, "mapping of option name -> default value", overridable=True,
                                      default_factory=lambda: MappingProxyType({}))
    option_rules: Mapping[str, Mapping[str, Any]] = _key(
        dict, "mapping of option name -> {'min': n, 'max': n, 'choices': [...]}",
        default_factory=lambda: MappingProxyType({}))
    runs_on: tuple[str, ...] = _key(list, "list of runtime targets the patch applies to: 'npu' and/or 'cpu'",
                                    default=TARGET_KINDS)
    packages: tuple[str, ...] = _key(
        list, "list of optional distributions the patch's targets live in (e.g. torchft): where one is not "
        "installed the patch is not applicable, never a problem", default=())

    @property
    def description(self) -> str:
        """The first line of the patch module's docstring."""
        return module_facts.read(self.module).description

    @property
    def targets(self) -> tuple[module_facts.Target, ...]:
        """The patch module's TARGETS, read from its source."""
        return module_facts.read(self.module).targets

    def to_json(self) -> dict[str, Any]:
        """Every key (defaults included), the module's description and targets, and the source."""
        entry = {key: _jsonable(getattr(self, key)) for key in ENTRY_KEYS}
        targets = [target.name if not target.condition else [target.name, target.condition]
                   for target in self.targets]
        return {"id": self.id, **entry, "description": self.description, "targets": targets,
                "source": self.source}


ENTRY_KEYS = {f.name: f for f in dataclasses.fields(PatchSpec) if "json_type" in f.metadata}
OVERRIDABLE_KEYS = tuple(name for name, f in ENTRY_KEYS.items() if f.metadata["overridable"])


def key_default(name: str) -> Any:
    """The value an entry gets when it leaves key ``name`` out (dataclasses.MISSING: required)."""
    key = ENTRY_KEYS[name]
    return key.default_factory() if key.default_factory is not dataclasses.MISSING else key.default


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return {name: _jsonable(item) for name, item in value.items()}
    return value


@dataclass
class Registry:
    patches: dict[str, PatchSpec] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    ranges: dict[str, Mapping[str, str]] = field(default_factory=dict)  # named version ranges, all documents

    def get(self, patch_id: str) -> PatchSpec:
        try:
            return self.patches[patch_id]
        except KeyError:
            raise ConfigError(unknown_id_message(patch_id, self.patches, "patch")) from None


def unknown_id_message(name: str, known: Mapping[str, Any] | list[str], what: str) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown {what} {name!r}{hint} (known: {', '.join(sorted(known))})"


def did_you_mean(unknown: list[str], allowed: Any) -> str:
    """'; did you mean ...?' naming the closest allowed name for each unknown one that has one ('' if none)."""
    pairs = [(name, close[0]) for name in unknown
             if (close := difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6))]
    if not pairs:
        return ""
    if len(unknown) == 1:
        return f"; did you mean {pairs[0][1]!r}?"
    return "; did you mean " + ", ".join(f"{match!r} for {name!r}" for name, match in pairs) + "?"


def read_json(path: str) -> Any:
    """Parse a JSON file; syntax errors name the file, line and column."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read registry file: {exc.strerror}") from None
    if not text.strip():
        raise ConfigError(f"{path}: empty registry file; a registry is a JSON object with a 'patches' key")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}"
        ) from None


def _string_list(where: str, key: str, value: list) -> tuple[str, ...]:
    for item in value:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{where}: every item of {key!r} must be a non-empty string, got {item!r}")
    return tuple(value)


def _parse_key(where: str, key: str, value: Any, ranges: Mapping[str, Mapping[str, str]]) -> Any:
    """A key's JSON value, checked and in its frozen form."""
    meta = ENTRY_KEYS[key].metadata
    if not isinstance(value, meta["json_type"]):
        raise ConfigError(f"{where}: key {key!r} must be {meta['meaning']}, got {type(value).__name__}")
    if key in ("triggers", "requires", "runs_on", "packages"):
        value = _string_list(where, key, value)
    if key == "runs_on":
        for item in value:
            if item not in TARGET_KINDS:
                raise ConfigError(f"{where}: 'runs_on' item {item!r} must be one of {', '.join(TARGET_KINDS)}"
                                  + did_you_mean([item], TARGET_KINDS))
    if key == "supports":
        value = _supports(where, value, ranges)
    if key == "option_rules":
        for name, rule in value.items():
            if not isinstance(rule, dict) or not rule or set(rule) - set(_RULE_KEYS):
                unknown = sorted(set(rule) - set(_RULE_KEYS)) if isinstance(rule, dict) else []
                raise ConfigError(
                    f"{where}: option_rules[{name!r}] must be an object with one or more of "
                    f"{', '.join(map(repr, _RULE_KEYS))}, got {rule!r}" + did_you_mean(unknown, _RULE_KEYS)
                )
        value = {name: MappingProxyType(dict(rule)) for name, rule in value.items()}
    return MappingProxyType(dict(value)) if isinstance(value, dict) else value


def check_options(where: str, options: Mapping[str, Any], rules: Mapping[str, Mapping[str, Any]]) -> None:
    """Every option value within its rule (min/max for numbers, choices for anything)."""
    for name, rule in rules.items():
        if name not in options:
            raise ConfigError(f"{where}: option_rules names {name!r}, which is not an option "
                              f"(options: {', '.join(sorted(options)) or '(none)'})" + did_you_mean([name], options))
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


def _supports(where: str, supports: Any, ranges: Mapping[str, Mapping[str, str]]) -> Mapping[str, str]:
    """A ``supports`` value (a mapping, or the name of a range) as a checked mapping."""
    if isinstance(supports, str):
        if supports not in ranges:
            raise ConfigError(f"{where}: 'supports' names the range {supports!r}, which no 'ranges' defines "
                              f"({unknown_id_message(supports, ranges, 'range')})")
        return ranges[supports]
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    for dist, spec in supports.items():
        if dist not in VERSIONED_DISTRIBUTIONS:
            raise ConfigError(f"{where}: 'supports' names {dist!r}; allowed: {', '.join(VERSIONED_DISTRIBUTIONS)}"
                              + did_you_mean([dist], VERSIONED_DISTRIBUTIONS))
        if not isinstance(spec, str):
            raise ConfigError(f"{where}: supports[{dist!r}] must be a PEP 440 specifier string")
        try:
            SpecifierSet(spec)
        except InvalidSpecifier:
            raise ConfigError(
                f"{where}: supports[{dist!r}]={spec!r} is not a PEP 440 specifier (e.g. '>=0.3,<0.4')"
            ) from None
    return MappingProxyType(dict(supports))


def _refuse_moved_keys(where: str, raw: dict) -> None:
    moved = [key for key in MOVED_KEYS if key in raw]
    if moved:
        raise ConfigError(f"{where}: key(s) {', '.join(map(repr, moved))} moved out of registries in schema "
                          f"{SCHEMA_VERSION}: " + "; ".join(MOVED_KEYS[key] for key in moved)
                          + ". Remove the key(s) from the entry")


def _full_entry(where: str, patch_id: str, raw: Any, source: str, defaults: Mapping[str, Any],
                ranges: Mapping[str, Mapping[str, str]]) -> PatchSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: entry must be a JSON object, got {type(raw).__name__}")
    _refuse_moved_keys(where, raw)
    unknown = sorted(set(raw) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(ENTRY_KEYS)}"
                          + did_you_mean(unknown, ENTRY_KEYS))
    missing = [key for key in ENTRY_KEYS if key_default(key) is dataclasses.MISSING and key not in raw]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(map(repr, missing))} (a new patch states them; "
                          f"every other key has a default)")
    values = {key: _parse_key(where, key, value, ranges) for key, value in raw.items()}
    values["supports"] = MappingProxyType({**defaults.get("supports", {}), **values.get("supports", {})})
    values.setdefault("module", f"{PATCH_PACKAGE}.{patch_id}")
    check_options(where, values.get("options", {}), values.get("option_rules", {}))
    return PatchSpec(id=patch_id, source=source, defined_in=source, **values)


def _override(where: str, base: PatchSpec, raw: Any, source: str,
              ranges: Mapping[str, Mapping[str, str]]) -> PatchSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: entry must be a JSON object, got {type(raw).__name__}")
    _refuse_moved_keys(where, raw)
    not_allowed = sorted(set(raw) - set(OVERRIDABLE_KEYS))
    if not_allowed:
        raise ConfigError(
            f"{where}: key(s) {', '.join(map(repr, not_allowed))} cannot be overridden for "
            f"existing patch {base.id!r}; allowed: {', '.join(OVERRIDABLE_KEYS)}"
            + did_you_mean(not_allowed, OVERRIDABLE_KEYS)
        )
    values = {key: _parse_key(where, key, value, ranges) for key, value in raw.items()}
    options = dict(base.options)
    for name, value in values.get("options", {}).items():
        if name not in options:
            raise ConfigError(
                f"{where}: unknown option {name!r} for patch {base.id!r}; "
                f"allowed: {', '.join(sorted(options)) or '(none)'}" + did_you_mean([name], options)
            )
        if options[name] is not None and type(value) is not type(options[name]):
            raise ConfigError(
                f"{where}: option {name!r} must be {type(options[name]).__name__} "
                f"like its default {options[name]!r}, got {value!r}"
            )
        options[name] = value
    check_options(where, options, base.option_rules)
    values["options"] = MappingProxyType(options)
    return dataclasses.replace(base, source=f"{base.source} + {source}", **values)


def _read_defaults(source: str, defaults: Any, ranges: Mapping[str, Mapping[str, str]]) -> Mapping[str, Any]:
    """A document's "defaults": the version ranges every new entry of that document supports."""
    where = f"{source}: 'defaults'"
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where} must be an object, got {type(defaults).__name__}")
    not_allowed = sorted(set(defaults) - {"supports"})
    if not_allowed:
        raise ConfigError(f"{where}: key(s) {', '.join(map(repr, not_allowed))} cannot have a document "
                          "default; allowed: 'supports' (every other key has its own default)"
                          + did_you_mean(not_allowed, ["supports"]))
    return {key: _parse_key(where, key, value, ranges) for key, value in defaults.items()}


def _read_ranges(source: str, ranges: Any) -> dict[str, Mapping[str, str]]:
    """A document's "ranges": named version ranges that 'supports' may name instead of restating them."""
    if not isinstance(ranges, dict):
        raise ConfigError(f"{source}: 'ranges' must be an object mapping a name -> {{distribution: specifier}}")
    parsed = {}
    for name, value in ranges.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: ranges[{name!r}] must be a mapping of distribution -> PEP 440 "
                              f"specifier, got {value!r}")
        parsed[name] = _supports(f"{source}: ranges[{name!r}]", value, {})
    return parsed


def merge_document(registry: Registry, document: Any, source: str) -> None:
    """Merge one registry document: new ids need full entries, known ids take overrides."""
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: top level must be a JSON object with a 'patches' key")
    top_level = ("schema", "ranges", "defaults", "patches")
    unknown = sorted(set(document) - set(top_level))
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
                          f"allowed: {', '.join(map(repr, top_level))}" + did_you_mean(unknown, top_level))
    schema = document.get("schema", SCHEMA_VERSION)
    if schema not in READABLE_SCHEMAS:
        raise ConfigError(f"{source}: 'schema' is {schema!r}; this runtime reads schemas "
                          f"{', '.join(map(str, READABLE_SCHEMAS))}")
    patches = document.get("patches")
    if not isinstance(patches, dict):
        raise ConfigError(f"{source}: 'patches' must be an object mapping patch id -> entry")
    registry.ranges.update(_read_ranges(source, document.get("ranges", {})))
    defaults = _read_defaults(source, document.get("defaults", {}), registry.ranges)
    for patch_id, raw in patches.items():
        where = f"{source}: patches[{patch_id!r}]"
        if patch_id in registry.patches:
            registry.patches[patch_id] = _override(where, registry.patches[patch_id], raw, source, registry.ranges)
        else:
            registry.patches[patch_id] = _full_entry(where, patch_id, raw, source, defaults, registry.ranges)
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
        try:
            loaded = entry_point.load()
        except (ImportError, AttributeError) as exc:
            dist = entry_point.dist
            publisher = f" (distribution {dist.name} {dist.version})" if dist else ""
            raise ConfigError(f"{source}{publisher}: cannot load: {exc}; fix or uninstall the distribution that "
                              "publishes it") from None
        if isinstance(loaded, (str, os.PathLike)):
            documents.append((f"{loaded} ({source})", read_json(os.fspath(loaded))))
        elif isinstance(loaded, dict):
            documents.append((source, loaded))
        else:
            raise ConfigError(f"{source}: must load to a registry dict or a JSON file path, got {type(loaded).__name__}")
    return documents


def validate_graph(registry: Registry) -> None:
    """Every requirement exists and there is no cycle. Errors name the file(s) that stated the requirements."""
    for spec in registry.patches.values():
        for required in spec.requires:
            if required in registry.patches:
                continue
            if required in RETIRED_IDS:
                raise ConfigError(f"{spec.defined_in}: patch {spec.id!r} requires {required!r}, which is no longer "
                                  f"a patch: {RETIRED_IDS[required]}")
            raise ConfigError(f"{spec.defined_in}: patch {spec.id!r} requires "
                              f"{unknown_id_message(required, registry.patches, 'patch')}")
    visiting: list[str] = []
    done: set[str] = set()

    def visit(patch_id: str) -> None:
        if patch_id in done:
            return
        if patch_id in visiting:
            raise ConfigError(_cycle_message(registry, visiting[visiting.index(patch_id):] + [patch_id]))
        visiting.append(patch_id)
        for required in registry.patches[patch_id].requires:
            visit(required)
        visiting.pop()
        done.add(patch_id)

    for patch_id in registry.patches:
        visit(patch_id)


def _cycle_message(registry: Registry, cycle: list[str]) -> str:
    """The cycle (a -> b -> a), the file(s) whose entries state it, and each requirement in it."""
    edges = list(zip(cycle, cycle[1:]))
    files = list(dict.fromkeys(registry.patches[patch_id].defined_in for patch_id, _ in edges))
    if len(files) == 1:
        stated = [f"patches[{patch_id!r}] requires {required!r}" for patch_id, required in edges]
    else:
        stated = [f"patches[{patch_id!r}] in {registry.patches[patch_id].defined_in} requires {required!r}"
                  for patch_id, required in edges]
    return (f"{' and '.join(files)}: requirement cycle between patches: {' -> '.join(cycle)} ({', '.join(stated)}); "
            "a patch cannot be applied after itself: remove one of these requirements")


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
