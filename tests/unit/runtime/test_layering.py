"""The package's layering, read from source: no import circle, patches are not libraries, the planner
patches torchtitan (not this project), and the runtime core imports neither torch nor torchtitan."""

from __future__ import annotations

import ast
import functools
import pathlib

import npu_inject

PACKAGE = pathlib.Path(npu_inject.__file__).parent
PATCHES = "npu_inject.patches"
# The start-up path and the runtime (docs/development.md): made and checked before torch is imported.
RUNTIME_CORE = ("_bootstrap", "settings", "errors", "registry", "selection", "runtime", "patching", "report")


def _module_name(path: pathlib.Path) -> str:
    parts = ("npu_inject", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(encoding="utf-8"), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()


def _imported(module: str, nodes) -> set[str]:
    """The npu_inject modules the import statements among ``nodes`` name: ``import a.b`` -> a.b;
    ``from a import b`` -> a.b where that is a module, else a."""
    modules = _modules()
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {name for name in found if name in modules}


def _imports(module: str) -> set[str]:
    """Every import in the module, function-level ones included."""
    return _imported(module, ast.walk(_modules()[module]))


def _top_level_statements(body):
    """Statements that run when the module is imported (not function bodies, not ``if TYPE_CHECKING:``)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _top_level_statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _top_level_statements(getattr(node, field, []))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "visiting"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "visiting":
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_graph_reader_sees_the_import_forms():
    graph = {module: _imports(module) for module in _modules()}
    assert "npu_inject.selection" in graph["npu_inject.runtime"]  # from npu_inject import selection as ...
    assert "npu_inject.errors" in graph["npu_inject.registry"]  # from npu_inject.errors import ConfigError
    assert "npu_inject.rank_agreement" in graph["npu_inject.runtime"]  # a function-level import
    assert "npu_inject.ops" in graph["npu_inject.ops.attention"]  # from npu_inject.ops import kernels
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_npu_inject():
    graph = {module: _imports(module) - {module} for module in _modules()}
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_module_outside_patches_imports_a_patch():
    offenders = sorted(f"{module} imports {imported}"
                       for module in _modules() if module != PATCHES and not module.startswith(PATCHES + ".")
                       for imported in _imports(module) if imported.startswith(PATCHES + "."))
    assert not offenders, ("a patch is no library: move what these need into a non-patch module both import: "
                           + "; ".join(offenders))


def _string_values(tree: ast.AST):
    """String literals, an f-string with '{}' where it formats a value."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)


def test_the_planner_declares_no_npu_inject_function_as_a_patch_target():
    declared = sorted(f"{path.name}:{line}: {value!r}"
                      for path in sorted((PACKAGE / "planner").glob("*.py"))
                      for line, value in _string_values(ast.parse(path.read_text(encoding="utf-8")))
                      if value.startswith("npu_inject.") and ":" in value)
    assert not declared, ("the planner changes this project's code through the hooks it owns "
                          "(npu_inject.ops.planner_hooks), not by patching it: " + "; ".join(declared))


def test_the_runtime_core_imports_neither_torch_nor_torchtitan_when_imported():
    modules = _modules()
    seen: set[str] = set()
    pending = [f"npu_inject.{name}" for name in RUNTIME_CORE]
    heavy = []
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        statements = list(_top_level_statements(modules[module].body))
        names = {alias.name for node in statements if isinstance(node, ast.Import) for alias in node.names}
        names |= {_resolve(module, node) for node in statements if isinstance(node, ast.ImportFrom)}
        heavy += [f"{module} imports {name}" for name in sorted(names)
                  if name.split(".")[0] in ("torch", "torchtitan", "torch_npu")]
        pending += sorted(_imported(module, statements))
    assert not heavy, heavy
