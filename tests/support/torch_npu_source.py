"""torch_npu as its sources say, and what our sources ask of it: both read with :mod:`ast`, never imported.

Our side (:func:`derive_uses`): every attribute chain rooted at ``torch_npu``, ``torch.npu`` or
``torch.ops.npu`` in the given files, with the keyword names of the calls made through it. A
chain's root is followed through imports (``import torch_npu.profiler as p``, ``from torch_npu
import profiler``), ``getattr(x, "name")``, ``importlib.import_module``/``find_spec`` with a
string, assignments, conditional expressions, function returns, arguments passed to our own
functions and classes, ``self.<attribute>`` and code strings run with ``python -c``. A
``ctx.replace("<module>:<attribute>", value)`` whose value is such a chain makes every use of
that attribute in the installed torchtitan a use of ours too (the device patch hands
``torch.npu`` to torchtitan as ``device_module``). A ``getattr`` whose name is not a constant
stands for every ``npu_*`` string constant of its file; ``**mapping`` arguments count with the
keys of a dict literal, of a dict our function builds, or of a dict variable of the caller.
Lookups that tolerate a missing name (``getattr``/``hasattr`` with a default, ``find_spec``, or
inside a ``try`` catching AttributeError, ImportError or Exception) are marked ``optional``.

The wheel's side (:class:`WheelAPI`): a chain resolves module by module and attribute by attribute
through the package's Python files (definitions, assignments, imports, star imports, class bodies
and their bases); ``torch.npu`` is the module torch_npu passes to
``torch._register_device_module("npu", ...)``; ``torch.ops.npu.<op>`` and ``torch_npu.npu_*``
are the ops of its schema file. A call's keywords are checked against the resolved function's
parameters (or a class's ``__new__``/``__init__``), following ``*args, **kwargs`` forwarded to
one function of the same module. Names from compiled modules (``torch_npu._C``) have no Python
source: their attributes count as present only where the wheel's own Python uses the same
``Name.attribute``.

Output facts (:func:`profiler_trace_layout`, :func:`memory_snapshot_fields`): what
``tensorboard_trace_handler`` writes and what ``torch.npu.memory._snapshot()`` returns, read
from (and for the trace directory's name, run from) the wheel's own source.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime as datetime_module
import importlib
import json
import os
import re
import types
import zipfile

TRACKED_ROOTS = (("torch_npu",), ("torch", "npu"), ("torch", "ops", "npu"))
MODULE_LOOKUPS = {("importlib", "import_module"), ("importlib", "util", "find_spec")}
PROBE_LOOKUPS = {("importlib", "util", "find_spec")}  # None when missing, not an error
OP_NAME = re.compile(r"npu_[a-z0-9_]+")
MODULE_STRING = re.compile(r"torch_npu(\.[A-Za-z_]\w*)*")
# What Python gives every module and class object, with no definition in its source.
IMPLICIT_ATTRIBUTES = {"__name__", "__doc__", "__file__", "__spec__", "__loader__", "__package__", "__path__",
                       "__dict__", "__qualname__", "__module__"}


@dataclasses.dataclass(frozen=True)
class Use:
    """One reference to a torch_npu name in our sources."""

    where: str  # file:line
    chain: tuple[str, ...]  # ("torch", "npu", "memory", "_snapshot")
    keywords: tuple[str, ...] | None = None  # keyword names of a call through it; None: not called
    positional: int | None = None  # positional arguments of the call; None: starred or not called
    optional: bool = False  # the code handles the name's absence (a probe)

    @property
    def dotted(self) -> str:
        return ".".join(self.chain)


def is_tracked(chain: tuple[str, ...] | None) -> bool:
    return chain is not None and any(chain[:len(root)] == root for root in TRACKED_ROOTS)


class _Sources:
    """Our files parsed, with a flat alias table per module (names do not shadow per scope)."""

    def __init__(self, files: dict[str, tuple[str, str]]):
        # module name -> (label for messages, source text)
        self.trees = {module: (label, ast.parse(text, filename=label)) for module, (label, text) in files.items()}
        self.aliases: dict[str, dict[str, tuple[str, ...]]] = {module: {} for module in self.trees}
        self.returns: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.replaced: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.functions: dict[tuple[str, ...], ast.FunctionDef | ast.ClassDef] = {}
        for module, (_, tree) in self.trees.items():
            package = module.split(".")
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    chain = (*package, node.name)
                    self.aliases[module][node.name] = chain
                    self.functions[chain] = node
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.asname:
                            self.aliases[module][alias.asname] = tuple(alias.name.split("."))
                        else:
                            top = alias.name.split(".")[0]
                            self.aliases[module][top] = (top,)
                elif isinstance(node, ast.ImportFrom):
                    base = self._absolute(module, node)
                    for alias in node.names:
                        if alias.name != "*":
                            self.aliases[module][alias.asname or alias.name] = (*base, alias.name)

    def _absolute(self, module: str, node: ast.ImportFrom) -> tuple[str, ...]:
        if not node.level:
            return tuple(node.module.split("."))
        parts = module.split(".")
        if not self.trees[module][0].endswith("__init__.py"):
            parts = parts[:-1]  # a module's own package
        parts = parts[:len(parts) - (node.level - 1)]
        return (*parts, *(node.module.split(".") if node.module else ()))

    def rewrite(self, chain: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """A chain through an attribute our code ``ctx.replace``-d, as the chain of what it holds."""
        if chain is None:
            return None
        for length in range(len(chain), 0, -1):
            if chain[:length] in self.replaced:
                return (*self.replaced[chain[:length]], *chain[length:])
        return chain

    def resolve(self, module: str, node: ast.AST) -> tuple[str, ...] | None:
        aliases = self.aliases[module]
        if isinstance(node, ast.Name):
            return self.rewrite(aliases.get(node.id))
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and f"self.{node.attr}" in aliases:
                return aliases[f"self.{node.attr}"]
            base = self.resolve(module, node.value)
            return self.rewrite((*base, node.attr)) if base else None
        if isinstance(node, ast.IfExp):
            return self.resolve(module, node.body) or self.resolve(module, node.orelse)
        if isinstance(node, ast.Call):
            func = self.resolve(module, node.func)
            if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
                base = self.resolve(module, node.args[0])
                name = node.args[1]
                if base and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    return (*base, name.value)
                return None
            if func in MODULE_LOOKUPS and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                return tuple(node.args[0].value.split("."))
            if func in self.returns:
                return self.returns[func]
        return None

    def propagate(self) -> None:
        """Aliases through assignments, returns, calls into our own code and ctx.replace, to a fixpoint."""
        changed = True
        while changed:
            changed = False
            for module, (_, tree) in self.trees.items():
                for node in ast.walk(tree):
                    changed |= self._propagate_node(module, node)

    def _bind(self, module: str, name: str, chain: tuple[str, ...] | None) -> bool:
        if not is_tracked(chain) or self.aliases[module].get(name) == chain:
            return False
        self.aliases[module][name] = chain
        return True

    def _propagate_node(self, module: str, node: ast.AST) -> bool:
        changed = False
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                        and len(target.elts) == len(node.value.elts):
                    pairs = list(zip(target.elts, node.value.elts))
                for name_node, value in pairs:
                    name = _target_name(name_node)
                    if name:
                        changed |= self._bind(module, name, self.resolve(module, value))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in ast.walk(node):
                if isinstance(statement, ast.Return) and statement.value is not None:
                    chain = self.resolve(module, statement.value)
                    owner = (*module.split("."), node.name)
                    if is_tracked(chain) and owner in self.functions and self.returns.get(owner) != chain:
                        self.returns[owner] = chain
                        changed = True
        elif isinstance(node, ast.Call):
            callee = self.resolve(module, node.func)
            if callee in self.functions:
                changed |= self._bind_arguments(callee, node, module)
            if isinstance(node.func, ast.Attribute) and node.func.attr == "replace" and len(node.args) == 2 \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                    and ":" in node.args[0].value:
                chain = self.resolve(module, node.args[1])
                where, attribute = node.args[0].value.split(":", 1)
                key = (*where.split("."), *attribute.split("."))
                if is_tracked(chain) and self.replaced.get(key) != chain:
                    self.replaced[key] = chain
                    changed = True
        return changed

    def _bind_arguments(self, callee: tuple[str, ...], call: ast.Call, module: str) -> bool:
        definition = self.functions[callee]
        callee_module = ".".join(callee[:-1])
        if isinstance(definition, ast.ClassDef):
            definition = next((n for n in definition.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                              None)
            if definition is None:
                return False
            parameters = [a.arg for a in definition.args.posonlyargs + definition.args.args][1:]  # self
        else:
            parameters = [a.arg for a in definition.args.posonlyargs + definition.args.args]
        changed = False
        for index, argument in enumerate(call.args):
            if index < len(parameters) and not isinstance(argument, ast.Starred):
                changed |= self._bind(callee_module, parameters[index], self.resolve(module, argument))
        for keyword in call.keywords:
            if keyword.arg:
                changed |= self._bind(callee_module, keyword.arg, self.resolve(module, keyword.value))
        return changed

    def spread_keys(self, module: str, node: ast.AST, scope: ast.AST | None = None) -> set[str] | None:
        """The keys of a ``**mapping`` argument: a dict literal, what one of our functions builds, or
        a dict variable of the enclosing function ``scope``. None when they cannot be derived."""
        if isinstance(node, ast.Dict):
            keys = set()
            for key, value in zip(node.keys, node.values):
                inner = {key.value} if isinstance(key, ast.Constant) else (
                    self.spread_keys(module, value) if key is None else None)
                if inner is None:
                    return None
                keys |= inner
            return keys
        if isinstance(node, ast.Call) and isinstance(self.functions.get(self.resolve(module, node.func)),
                                                     ast.FunctionDef):
            return _built_keys(self.functions[self.resolve(module, node.func)])
        if isinstance(node, ast.Name) and scope is not None:
            return self._variable_keys(module, node.id, scope)
        return None

    def _variable_keys(self, module: str, name: str, scope: ast.AST) -> set[str] | None:
        """Keys a dict variable gets in its function: assignments, ``.update(...)``, ``[key] =``."""
        keys: set[str] = set()
        for node in ast.walk(scope):
            part: set[str] | None = set()
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                part = self.spread_keys(module, node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == name:
                part = {k.arg for k in node.keywords if k.arg}
                for inner in [*node.args, *(k.value for k in node.keywords if k.arg is None)]:
                    inner_keys = self.spread_keys(module, inner)
                    part = None if inner_keys is None or part is None else part | inner_keys
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == name:
                part = {node.slice.value} if isinstance(node.slice, ast.Constant) else None
            if part is None:
                return None
            keys |= part
        return keys

    def uses(self, module: str) -> list[Use]:
        label, tree = self.trees[module]
        found: dict[tuple, Use] = {}
        calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
        probes = _probe_nodes(tree)
        op_constants = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                               and isinstance(n.value, str) and OP_NAME.fullmatch(n.value)
                               and not n.value.startswith("npu_inject")})

        def add(node: ast.AST, chain: tuple[str, ...], optional: bool = False) -> None:
            call = calls.get(id(node))
            keywords = positional = None
            if call is not None:
                names = set()
                for keyword in call.keywords:
                    spread = {keyword.arg} if keyword.arg else self.spread_keys(module, keyword.value,
                                                                                  scopes.get(id(call), tree))
                    names |= spread if spread is not None else {f"**{ast.unparse(keyword.value)} (keys not derivable)"}
                keywords = tuple(sorted(names))
                positional = None if any(isinstance(a, ast.Starred) for a in call.args) else len(call.args)
            use = Use(f"{label}:{node.lineno}", chain, keywords, positional, optional or id(node) in probes)
            found[(use.where, use.chain, use.keywords)] = use

        scopes = {}  # call -> innermost enclosing function
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(function):
                    if isinstance(inner, ast.Call):
                        scopes[id(inner)] = function  # inner functions come later in the walk: they win
        module_arguments: set[int] = set()  # string constants already read as a module lookup's argument
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                chain = self.resolve(module, node)
                if is_tracked(chain):
                    add(node, chain)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) in calls:
                chain = self.resolve(module, node)
                if is_tracked(chain):
                    add(node, chain)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    base = self._absolute(module, node) if isinstance(node, ast.ImportFrom) else ()
                    chain = (*base, alias.name) if isinstance(node, ast.ImportFrom) else tuple(alias.name.split("."))
                    if is_tracked(chain) and alias.name != "*":
                        add(node, chain)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                   "hasattr"):
                base = self.resolve(module, node.args[0]) if node.args else None
                if is_tracked(base) and len(node.args) >= 2:
                    name = node.args[1]
                    optional = node.func.id == "hasattr" or len(node.args) == 3 or id(node) in probes
                    if isinstance(name, ast.Constant):
                        add(node, (*base, name.value), optional)
                    elif not op_constants:
                        found[(f"{label}:{node.lineno}", base, "dynamic")] = Use(
                            f"{label}:{node.lineno}", (*base, "<dynamic name: no npu_* constant in the file>"))
                    else:  # a computed name: every op name the file spells out
                        for op in op_constants:
                            add(node, (*base, op), optional)
            elif isinstance(node, ast.Call) and self.resolve(module, node.func) in MODULE_LOOKUPS:
                argument = node.args[0] if node.args else None
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str) \
                        and MODULE_STRING.fullmatch(argument.value):
                    optional = self.resolve(module, node.func) in PROBE_LOOKUPS or id(node) in probes
                    module_arguments.add(id(argument))
                    found[(f"{label}:{node.lineno}", argument.value, "module")] = Use(
                        f"{label}:{node.lineno}", tuple(argument.value.split(".")), optional=optional)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and MODULE_STRING.fullmatch(node.value) and id(node) not in module_arguments:
                found.setdefault((f"{label}:{node.lineno}", node.value, "string"),
                                 Use(f"{label}:{node.lineno}", tuple(node.value.split("."))))
        return list(found.values())


def _built_keys(function: ast.FunctionDef) -> set[str] | None:
    """String keys a function puts in the dicts it builds: literal keys and ``d[k] = ...`` with k a
    constant or a loop variable over constants. None when some key is computed otherwise."""
    loops = {}
    for node in ast.walk(function):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, (ast.Tuple, ast.List)):
            loops[node.target.id] = {e.value for e in node.iter.elts if isinstance(e, ast.Constant)}
    keys: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Dict):
            for key in node.keys:
                if not isinstance(key, ast.Constant):
                    return None
                keys.add(key.value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
            elif isinstance(node.slice, ast.Name) and node.slice.id in loops:
                keys |= loops[node.slice.id]
            else:
                return None
    return keys


def _target_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _probe_nodes(tree: ast.AST) -> set[int]:
    """Nodes inside a ``try`` that catches AttributeError, ImportError or any Exception: absence is handled."""
    probed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = set()
            for handler in node.handlers:
                kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                caught |= {k.id for k in kinds if isinstance(k, ast.Name)}
            if caught & {"AttributeError", "ImportError", "ModuleNotFoundError", "Exception", "BaseException"}:
                for statement in node.body:
                    probed |= {id(n) for n in ast.walk(statement)}
    return probed


def _code_strings(tree: ast.AST, label: str) -> list[tuple[str, str]]:
    """Python code given to ``python -c`` in a list literal: (label with line, code)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for flag, code in zip(node.elts, node.elts[1:]):
                if isinstance(flag, ast.Constant) and flag.value == "-c" and isinstance(code, ast.Constant) \
                        and isinstance(code.value, str):
                    found.append((f"{label}:{code.lineno} (python -c)", code.value))
    return found


def module_name(path: str, root: str) -> str:
    relative = os.path.relpath(os.path.realpath(path), root)[:-len(".py")].split(os.sep)
    if relative[-1] == "__init__":
        relative = relative[:-1]
    return ".".join(relative)


def derive_uses(paths: list[str], root: str, consumer_roots: list[str]) -> list[Use]:
    """Every torch_npu name our files use, and the uses in ``consumer_roots`` (installed packages'
    directories) of module attributes our files ``ctx.replace`` with a torch_npu object."""
    files: dict[str, tuple[str, str]] = {}
    for path in sorted({os.path.realpath(p) for p in paths}):
        label = os.path.relpath(path, root)
        text = open(path, encoding="utf-8").read()
        files[module_name(path, root)] = (label, text)
        for index, (where, code) in enumerate(_code_strings(ast.parse(text), label)):
            files[f"<code {label} {index}>"] = (where, code)
    ours = _Sources(files)
    ours.propagate()
    uses = [use for module in ours.trees for use in ours.uses(module)]
    # The replaced attributes, where the consumers read them.
    for key, chain in ours.replaced.items():
        owner, attribute = ".".join(key[:-1]), key[-1]
        consumer_files = {}
        for directory in consumer_roots:
            parent = os.path.dirname(directory)
            for folder, _, names in os.walk(directory):
                for name in names:
                    path = os.path.join(folder, name)
                    if name.endswith(".py") and attribute in open(path, encoding="utf-8").read():
                        consumer_files[module_name(path, parent)] = (os.path.relpath(path, parent),
                                                                     open(path, encoding="utf-8").read())
        theirs = _Sources(consumer_files)
        theirs.replaced[key] = chain
        if owner in theirs.aliases:  # the defining module's own global
            theirs.aliases[owner][attribute] = chain
        theirs.propagate()
        uses += [use for module in theirs.trees for use in theirs.uses(module)]
    return uses


# -- the wheel ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Target:
    """What a dotted name is in the wheel."""

    kind: str  # module | function | class | value | compiled | external | op
    name: str  # dotted name
    member: str = ""  # wheel file holding it
    node: ast.AST | None = None  # its definition


class WheelAPI:
    """Names, parameters and modules of a torch_npu wheel, from its Python sources."""

    def __init__(self, archive: zipfile.ZipFile, op_names: set[str]):
        self.archive = archive
        self.version = os.path.basename(archive.filename or "torch_npu wheel")
        self.members = set(archive.namelist())
        self.op_names = op_names
        self._trees: dict[str, ast.Module] = {}

    def tree(self, member: str) -> ast.Module:
        if member not in self._trees:
            self._trees[member] = ast.parse(self.archive.read(member).decode(), filename=member)
        return self._trees[member]

    def module(self, dotted: str) -> Target | None:
        path = dotted.replace(".", "/")
        for member in (f"{path}/__init__.py", f"{path}.py"):
            if member in self.members:
                return Target("module", dotted, member)
        parts = dotted.split(".")
        for length in range(len(parts), 0, -1):  # torch_npu._C._profiler lives in torch_npu/_C*.so
            prefix = "/".join(parts[:length]) + "."
            if any(m.startswith(prefix) and m.endswith(".so") and "/" not in m[len(prefix):] for m in self.members):
                return Target("compiled", dotted)
        return None

    def device_module(self) -> str:
        """The module torch_npu registers as ``torch.npu``."""
        for member in sorted(m for m in self.members if m.startswith("torch_npu/") and m.endswith(".py")):
            text = self.archive.read(member).decode(errors="replace")
            if "_register_device_module" not in text:
                continue
            for node in ast.walk(self.tree(member)):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_register_device_module" \
                        and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                        and node.args[0].value == "npu":
                    return ast.unparse(node.args[1])
        raise LookupError(f"{self.archive.filename}: no torch._register_device_module('npu', ...) call")

    def resolve(self, chain: tuple[str, ...]) -> tuple[Target | None, str]:
        """The target of a chain, or None and why not."""
        if chain[:3] == ("torch", "ops", "npu"):
            if len(chain) == 3:
                return Target("module", "torch.ops.npu"), ""
            if chain[3] in self.op_names:
                return Target("op", chain[3]), ""
            return None, f"torch_npu defines no op {chain[3]} (npu_native_functions*.yaml)"
        if chain[:2] == ("torch", "npu"):
            chain = (*self.device_module().split("."), *chain[2:])
        target = self.module(chain[0])
        if target is None:
            return None, f"the wheel has no module {chain[0]}"
        for index, attribute in enumerate(chain[1:], start=1):
            if target.kind == "module" and chain[0] == "torch_npu" and index == 1 and attribute in self.op_names:
                target = Target("op", attribute)
                continue
            found = self.attribute(target, attribute)
            if found is None:
                return None, f"{target.name} ({target.member or target.kind}) has no {attribute}"
            target = found
        return target, ""

    def attribute(self, owner: Target, name: str, depth: int = 0) -> Target | None:
        if depth > 12:
            raise RecursionError(f"import cycle resolving {owner.name}.{name}")
        dotted = f"{owner.name}.{name}"
        if owner.kind in ("module", "class") and name in IMPLICIT_ATTRIBUTES:
            return Target("value", dotted, owner.member)
        if owner.kind == "module":
            submodule = self.module(dotted)
            if submodule is not None:
                return submodule
            return self._in_module(owner, name, depth)
        if owner.kind == "class":
            return self._in_class(owner, name, depth)
        if owner.kind == "external":
            return _external_attribute(owner.name, name)
        if owner.kind in ("compiled", "value"):
            evidence = self.used_by_wheel(owner.name.rsplit(".", 1)[-1], name)
            return Target("value", dotted, evidence) if evidence else None
        return None

    def _in_module(self, owner: Target, name: str, depth: int) -> Target | None:
        stars = []
        for node in _module_level(self.tree(owner.member)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Target("function", f"{owner.name}.{name}", owner.member, node)
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Target("class", f"{owner.name}.{name}", owner.member, node)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
                if name in names:
                    if isinstance(node.value, (ast.Name, ast.Attribute)) and ast.unparse(node.value) != name:
                        followed = self._expression(owner, node.value, depth + 1)
                        if followed is not None:
                            return followed
                    return Target("value", f"{owner.name}.{name}", owner.member, node)
            if isinstance(node, ast.ImportFrom):
                base = _absolute_import(owner, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(base)
                    elif (alias.asname or alias.name) == name:
                        return self._imported(base, alias.name, depth)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == name:
                        dotted = alias.name if alias.asname else alias.name.split(".")[0]
                        return self.module(dotted) or Target("external", dotted)
        for base in stars:
            source = self.module(base)
            if source is not None and source.kind == "module" and name in self._star_names(source):
                return self.attribute(source, name, depth + 1)
        return None

    def _star_names(self, module: Target) -> set[str]:
        tree = self.tree(module.member)
        for node in _module_level(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                if isinstance(node.value, (ast.List, ast.Tuple)):
                    return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        return {n for n in _bound_names(tree) if not n.startswith("_")}

    def _imported(self, base: str, name: str, depth: int) -> Target | None:
        if not base.startswith("torch_npu"):
            submodule = _external_module(f"{base}.{name}")
            return submodule or _external_attribute(base, name)
        submodule = self.module(f"{base}.{name}")
        if submodule is not None:
            return submodule
        source = self.module(base)
        if source is None:
            return None
        if source.kind == "compiled":
            return Target("compiled", f"{base}.{name}")
        return self.attribute(source, name, depth + 1)

    def _expression(self, owner: Target, node: ast.AST, depth: int) -> Target | None:
        if isinstance(node, ast.Name):
            return self._in_module(owner, node.id, depth)
        if isinstance(node, ast.Attribute):
            base = self._expression(owner, node.value, depth)
            return self.attribute(base, node.attr, depth) if base is not None else None
        return None

    def _in_class(self, owner: Target, name: str, depth: int) -> Target | None:
        for node in owner.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                return Target(kind, f"{owner.name}.{name}", owner.member, node)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return Target("value", f"{owner.name}.{name}", owner.member, node)
        for base in self.bases(owner):
            found = self.attribute(base, name, depth + 1)
            if found is not None:
                return found
        return None

    def bases(self, owner: Target) -> list[Target]:
        module = Target("module", owner.name.rsplit(".", 1)[0], owner.member)
        found = []
        for base in owner.node.bases:
            target = self._expression(module, base, 0)
            if target is not None:
                found.append(target)
        return found

    def used_by_wheel(self, name: str, attribute: str) -> str:
        """'file:line' where the wheel's Python reads ``<name>.<attribute>``, or ''."""
        for member in sorted(m for m in self.members if m.startswith("torch_npu/") and m.endswith(".py")):
            text = self.archive.read(member).decode(errors="replace")
            if f"{name}.{attribute}" not in text:
                continue
            for node in ast.walk(self.tree(member)):
                if isinstance(node, ast.Attribute) and node.attr == attribute and (
                        getattr(node.value, "id", None) == name or getattr(node.value, "attr", None) == name):
                    return f"{member}:{node.lineno}"
        return ""

    def parameters(self, target: Target) -> tuple[set[str], int, bool, bool] | None:
        """(keyword-capable names, positional capacity, takes *args, takes **kwargs) of a callable;
        None when the wheel's Python does not say (compiled or external)."""
        if target.kind == "function":
            return self._function_parameters(target, target.node, bound=_is_method(target))
        if target.kind == "class":
            for method in ("__new__", "__init__"):
                found = self._in_class(target, method, 0)
                if found is not None and found.kind == "function":
                    return self._function_parameters(found, found.node, bound=True)
                if found is not None and found.kind == "external":
                    return _external_parameters(found.name)
            return set(), 0, False, False
        if target.kind == "external":
            return _external_parameters(target.name)
        return None

    def _function_parameters(self, target: Target, node, bound: bool):
        arguments = node.args
        named = arguments.posonlyargs + arguments.args
        first = named[0].arg if bound and named else None
        positional = [a.arg for a in named if a.arg != first]
        keywords = {a.arg for a in arguments.args + arguments.kwonlyargs} - {first}
        if arguments.kwarg is not None:
            forwarded = self._forwarded(target, node, arguments.kwarg.arg)
            if forwarded is not None:
                names, capacity, star, kwarg = forwarded
                return keywords | names, max(len(positional), capacity), star, kwarg
        return keywords, len(positional), arguments.vararg is not None, arguments.kwarg is not None

    def _forwarded(self, target: Target, node, kwarg: str):
        """The parameters of the one module function ``**kwarg`` is passed on to."""
        module = Target("module", target.name.rsplit(".", 1)[0], target.member)
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and any(
                    k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg for k in call.keywords):
                callee = self._in_module(module, call.func.id, 0)
                if callee is not None and callee.kind == "function":
                    return self._function_parameters(callee, callee.node, bound=False)
        return None


def _is_method(target: Target) -> bool:
    return target.node is not None and bool(target.node.args.args) and target.node.args.args[0].arg in ("self",
                                                                                                        "cls")


def _module_level(tree: ast.Module):
    """Statements run at import, inside if/try/with blocks too, not inside functions or classes."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            pending[:0] = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                           *[s for h in getattr(node, "handlers", []) for s in h.body]]


def _bound_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in _module_level(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    return names


def _absolute_import(owner: Target, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    package = owner.name.split(".")
    if not owner.member.endswith("__init__.py"):
        package = package[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


# Names torch_npu takes from torch itself: looked up in the installed torch (not from the wheel).
def _external_module(dotted: str) -> Target | None:
    try:
        importlib.import_module(dotted)
    except ImportError:
        return None
    return Target("external", dotted)


def _external_object(dotted: str):
    parts = dotted.split(".")
    for length in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:length]))
        except ImportError:
            continue
        for part in parts[length:]:
            value = getattr(value, part)
        return value
    raise ImportError(dotted)


def _external_attribute(owner: str, name: str) -> Target | None:
    try:
        value = _external_object(owner)
    except (ImportError, AttributeError):
        return None
    return Target("external", f"{owner}.{name}") if hasattr(value, name) else None


def _external_parameters(dotted: str):
    import inspect

    try:
        signature = inspect.signature(_external_object(dotted))
    except (ValueError, TypeError, ImportError, AttributeError):
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    names = {p.name for p in signature.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                     for k in kinds)
    return (names, positional, inspect.Parameter.VAR_POSITIONAL in kinds,
            inspect.Parameter.VAR_KEYWORD in kinds)


def check_in_wheel(use: Use, api: WheelAPI) -> str:
    """'' when the wheel has the name and its callable takes the call's keywords, else why not."""
    if "<dynamic" in use.dotted or any(k.startswith("**") for k in use.keywords or ()):
        return f"{use.where}: {use.dotted}{_call(use)}: the name or keywords cannot be derived from our source"
    target, why = api.resolve(use.chain)
    if target is None:
        return f"{use.where}: {use.dotted}: missing from torch_npu {api.version}: {why}"
    if use.keywords is None or target.kind == "op":
        return ""  # ops: their keywords are checked against the schema file
    parameters = api.parameters(target)
    if parameters is None:
        if use.keywords:
            return (f"{use.where}: {use.dotted}{_call(use)}: {target.name} is {target.kind} ({target.member}); "
                    f"its parameters cannot be read from the wheel's Python")
        return ""
    names, capacity, star, kwarg = parameters
    unknown = sorted(set(use.keywords) - names) if not kwarg else []
    if unknown:
        return (f"{use.where}: {use.dotted}{_call(use)}: torch_npu's {target.name} ({target.member}) "
                f"takes no keyword {unknown}; it takes {sorted(names)}")
    if use.positional is not None and use.positional > capacity and not star:
        return (f"{use.where}: {use.dotted}{_call(use)}: torch_npu's {target.name} ({target.member}) "
                f"takes at most {capacity} positional arguments")
    return ""


def _call(use: Use) -> str:
    if use.keywords is None:
        return ""
    return f"({use.positional} positional{''.join(f', {k}=' for k in use.keywords)})"


# -- what torch_npu writes ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TraceLayout:
    """Where ``torch_npu.profiler.tensorboard_trace_handler(dir_name, worker_name=...)`` puts a trace."""

    directory: str  # regex for the folder created in dir_name; groups: worker, pid, stamp
    output_dir: str  # the analysis output inside it (ASCEND_PROFILER_OUTPUT)
    trace_file: str  # the Chrome trace inside that (trace_view.json)
    trace_type: type  # the JSON document's top-level type
    sources: tuple[str, ...]  # wheel files:lines the facts were read from


def profiler_trace_layout(api: WheelAPI) -> TraceLayout:
    """Read from the wheel: the handler's path creator is run (its own code, on fixed pid, host and
    clock), the analysis output folder and trace file name are read from the parsers' source."""
    handler, why = api.resolve(("torch_npu", "profiler", "tensorboard_trace_handler"))
    if handler is None or handler.kind != "function":
        raise LookupError(f"torch_npu.profiler.tensorboard_trace_handler: {why or handler}")
    creator = _path_creator(api, handler)
    names = {}
    for case, (worker, pid, when) in {
        "a": ("WORKER", 424242, datetime_module.datetime(2031, 1, 2, 3, 4, 5, 678000, datetime_module.timezone.utc)),
        "b": ("WORKER", 515151, datetime_module.datetime(1999, 11, 12, 13, 14, 15, 161000,
                                                         datetime_module.timezone.utc)),
        "default": (None, 424242, datetime_module.datetime(2031, 1, 2, 3, 4, 5, 678000,
                                                           datetime_module.timezone.utc)),
    }.items():
        names[case] = _run_path_creator(api, creator, worker, pid, when)
    a = names["a"].replace("WORKER", "\0w").replace("424242", "\0p")
    b = names["b"].replace("WORKER", "\0w").replace("515151", "\0p")
    prefix = os.path.commonprefix([a, b])
    suffix = os.path.commonprefix([a[::-1], b[::-1]])[::-1]
    stamp_a, stamp_b = a[len(prefix):len(a) - len(suffix)], b[len(prefix):len(b) - len(suffix)]
    if not (stamp_a.isdigit() and stamp_b.isdigit() and len(stamp_a) == len(stamp_b)):
        raise LookupError(f"{creator.member}: the trace folder's time stamp is not a fixed run of digits: "
                          f"{names['a']!r} / {names['b']!r}")
    pattern = (re.escape(prefix) + f"(?P<stamp>\\d{{{len(stamp_a)}}})" + re.escape(suffix))
    pattern = pattern.replace(re.escape("\0w"), "(?P<worker>.+)").replace(re.escape("\0p"), "(?P<pid>\\d+)")
    if not re.fullmatch(pattern.replace("(?P<worker>.+)", re.escape("HOST")), names["default"]):
        raise LookupError(f"{creator.member}: without worker_name the folder is {names['default']!r}, "
                          f"not the pattern {pattern} with the host name as worker")
    output_dir, output_where = _tensorboard_output_dir(api)
    trace_file, trace_type, trace_where = _trace_view(api)
    return TraceLayout(pattern, output_dir, trace_file, trace_type,
                       (f"{creator.member}:{creator.node.lineno}", output_where, trace_where))


def _path_creator(api: WheelAPI, handler: Target) -> Target:
    """The class whose ``().init(worker_name=worker_name, dir_name=dir_name)`` the handler calls."""
    module = Target("module", handler.name.rsplit(".", 1)[0], handler.member)
    for node in ast.walk(handler.node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "init" \
                and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name):
            passed = {k.arg: getattr(k.value, "id", None) for k in node.keywords}
            if passed.get("worker_name") == "worker_name" and passed.get("dir_name") == "dir_name":
                creator = api._in_module(module, node.func.value.func.id, 0)
                if creator is not None and creator.kind == "class":
                    return creator
    raise LookupError(f"{handler.member}: tensorboard_trace_handler no longer passes worker_name and dir_name "
                      f"to a path creator's init(); read what it does and update this reader")


class _Stub:
    """PathManager-style helpers: the two that compute or create paths behave, checks pass."""

    get_realpath = staticmethod(os.path.realpath)

    @staticmethod
    def make_dir_safety(path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _run_path_creator(api: WheelAPI, creator: Target, worker: str | None, pid: int, when) -> str:
    """The folder name torch_npu's own path creator makes, on a fixed pid, host name and clock."""
    import shutil
    import tempfile

    class FrozenDatetime(datetime_module.datetime):
        @classmethod
        def now(cls, tz=None):
            return when.astimezone(tz) if tz else when.astimezone().replace(tzinfo=None)

    fixed_os = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
    fixed_os.getpid = lambda: pid
    fixed_socket = types.SimpleNamespace(gethostname=lambda: "HOST")
    module = Target("module", creator.name.rsplit(".", 1)[0], creator.member)
    constants, _ = api.resolve(tuple(_imported_name(api, module, "Constant").split(".")))

    def warn(message):
        raise AssertionError(f"torch_npu's path creator warned: {message}")

    namespace = {"os": fixed_os, "socket": fixed_socket, "shutil": shutil, "datetime": FrozenDatetime,
                 "timezone": datetime_module.timezone, "Constant": _class_constants(constants),
                 "PathManager": _Stub(), "ProfilerPathManager": _Stub(), "print_warn_msg": warn}
    definition = ast.ClassDef(**{**{f: getattr(creator.node, f) for f in creator.node._fields},
                                 "decorator_list": []})
    exec(compile(ast.fix_missing_locations(ast.Module([definition], [])), creator.member, "exec"), namespace)
    instance = namespace[creator.node.name]()
    with tempfile.TemporaryDirectory() as folder:
        instance.init(worker_name=worker, dir_name=folder)
        instance.create_prof_dir()
        made = instance.get_prof_dir()
        if os.path.dirname(made) != os.path.realpath(folder):
            raise LookupError(f"{creator.member}: the trace folder {made!r} is not directly in dir_name {folder!r}")
    return os.path.basename(made)


def _imported_name(api: WheelAPI, owner: Target, name: str) -> str:
    for node in _module_level(api.tree(owner.member)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{_absolute_import(owner, node)}.{alias.name}"
    raise LookupError(f"{owner.member} imports no {name}")


def _class_constants(target: Target | None) -> types.SimpleNamespace:
    """A class's literal attributes (``X = "..."``), the others left out."""
    values = {}
    for node in target.node.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return types.SimpleNamespace(**values)


def _profiler_sources(api: WheelAPI):
    for member in sorted(m for m in api.members if m.startswith("torch_npu/profiler/") and m.endswith(".py")):
        yield member, api.tree(member)


def _tensorboard_output_dir(api: WheelAPI) -> tuple[str, str]:
    """``os.path.join(profiler_path, Constant.X)`` set as the output path for TENSORBOARD_TRACE_HANDLER."""
    for member, tree in _profiler_sources(api):
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TENSORBOARD_TRACE_HANDLER" in ast.unparse(node.test):
                for statement in node.body:
                    text = ast.unparse(statement)
                    match = re.fullmatch(r"self\._output_path = os\.path\.join\(\w+, (\w+)\.(\w+)\)", text)
                    if match:
                        owner = Target("module", member[:-3].replace("/", "."), member)
                        constants = _class_constants(api._in_module(owner, match.group(1), 0))
                        return getattr(constants, match.group(2)), f"{member}:{statement.lineno}"
    raise LookupError("no profiler parser sets self._output_path = os.path.join(<path>, Constant.<dir>) "
                      "for TENSORBOARD_TRACE_HANDLER in the wheel; read where trace_view.json goes now")


def _trace_view(api: WheelAPI) -> tuple[str, type, str]:
    """TraceViewParser: the file name joined to the output path, and the type of what it writes there."""
    for member, tree in _profiler_sources(api):
        for cls in ast.walk(tree):
            if not (isinstance(cls, ast.ClassDef) and cls.name == "TraceViewParser"):
                continue
            constants = _class_constants(Target("class", cls.name, member, cls))
            literals, name, written = {}, None, None
            for node in ast.walk(cls):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target, value = ast.unparse(node.targets[0]), node.value
                    if isinstance(value, (ast.List, ast.Dict)):
                        literals[target] = list if isinstance(value, ast.List) else dict
                    join = re.search(r"os\.path\.join\(self\._output_path, self\.(\w+)\)", ast.unparse(value))
                    if target == "self._trace_file_path" and join:
                        name = getattr(constants, join.group(1))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "create_json_file_by_path" \
                        and len(node.args) == 2 and ast.unparse(node.args[0]) == "self._trace_file_path":
                    written = ast.unparse(node.args[1])
            if name and written in literals:
                return name, literals[written], f"{member}:{cls.lineno}"
    raise LookupError("the wheel's TraceViewParser no longer joins self.TRACE_VIEW to its output path and "
                      "writes a list or dict literal there; read what it writes now")


def memory_snapshot_fields(api: WheelAPI) -> tuple[dict[str, str], str]:
    """The keys (and documented types) of ``torch.npu.memory._snapshot()``'s dictionary.

    Read from the Snapshot TypedDict in ``_snapshot``'s docstring; each key must also be a string of
    libtorch_npu.so, which builds the dictionary (``torch_npu._C._npu_memorySnapshot``)."""
    snapshot, why = api.resolve(("torch", "npu", "memory", "_snapshot"))
    if snapshot is None or snapshot.kind != "function":
        raise LookupError(f"torch.npu.memory._snapshot: {why or snapshot}")
    docstring = ast.get_docstring(snapshot.node) or ""
    block = re.search(r"class Snapshot\(TypedDict\):\n((?:[ \t]+\w+\s*:.*\n)+)", docstring)
    if block is None:
        raise LookupError(f"{snapshot.member}: _snapshot's docstring documents no 'class Snapshot(TypedDict)'")
    fields = dict(re.findall(r"^\s+(\w+)\s*:\s*(.+?)\s*$", block.group(1), re.M))
    library = api.archive.read("torch_npu/lib/libtorch_npu.so")
    absent = [key for key in fields if b"\0" + key.encode() + b"\0" not in library]
    if absent:
        raise LookupError(f"{snapshot.member}: documented snapshot keys {absent} are no string of "
                          f"libtorch_npu.so, which builds the snapshot: the docstring is stale")
    return fields, f"{snapshot.member}:{snapshot.node.lineno}"


def conforms(value, annotation: str) -> bool:
    """A value against a documented type: List[...] nests, other TypedDict names are dicts."""
    annotation = annotation.strip()
    inner = re.fullmatch(r"List\[(.*)\]", annotation)
    if inner:
        return isinstance(value, list) and all(conforms(item, inner.group(1)) for item in value)
    builtin = {"int": int, "str": str, "bool": bool, "float": float}.get(annotation)
    return isinstance(value, builtin) if builtin else isinstance(value, dict)


def trace_problems(layout: TraceLayout, folder: str, worker: str, pid: int | None = None) -> list[str]:
    """What in ``folder`` differs from one trace written by torch_npu's handler for ``worker`` (and ``pid``)."""
    entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    matches = [(name, re.fullmatch(layout.directory, name)) for name in entries]
    traces = [(name, match) for name, match in matches if match and match["worker"] == worker]
    if len(traces) != 1:
        return [f"{folder}: expected one folder named like torch_npu's {layout.directory} for worker "
                f"{worker!r} ({', '.join(layout.sources)}), found {entries}"]
    name, match = traces[0]
    problems = []
    if pid is not None and int(match["pid"]) != pid:
        problems.append(f"{folder}/{name}: pid {match['pid']}, the writing process was {pid}")
    path = os.path.join(folder, name, layout.output_dir, layout.trace_file)
    if not os.path.isfile(path):
        return problems + [f"{folder}/{name}: no {layout.output_dir}/{layout.trace_file} "
                           f"(in it: {sorted(os.listdir(os.path.join(folder, name)))})"]
    with open(path, encoding="utf-8") as trace:
        document = json.load(trace)
    if not isinstance(document, layout.trace_type) or not document:
        problems.append(f"{path}: a {type(document).__name__} ({len(document)} entries); torch_npu writes a "
                        f"non-empty JSON {layout.trace_type.__name__} of events")
    return problems


def snapshot_problems(snapshot: dict, fields: dict[str, str]) -> list[str]:
    """How a memory snapshot differs from torch_npu's documented Snapshot dictionary."""
    problems = []
    if set(snapshot) != set(fields):
        problems.append(f"keys {sorted(snapshot)}, torch_npu's are {sorted(fields)}")
    problems += [f"{key} is not {fields[key]}: {snapshot[key]!r:.200}" for key in fields
                 if key in snapshot and not conforms(snapshot[key], fields[key])]
    return problems
