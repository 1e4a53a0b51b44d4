"""memfit_gpu's import structure, read from the source with `ast` (nothing is imported): every import
statement of the package's modules, the module graph they make, its cycles, and the layers of
docs/concepts/design.md's module graph. One implementation for tests/test_architecture.py (the rules) and
docs/hooks/module_graph.py (the generated module-graph page).

Every import of a memfit_gpu module counts, wherever it is written: module level, inside a function,
under `if TYPE_CHECKING:`; relative imports are resolved, `from pkg import submodule` is an edge to the
submodule, and importing `a.b.c` also runs `a/__init__` and `a/b/__init__` (edges to those packages,
unless the importer lies inside them).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    importer: str  # module that imports
    target: str  # imported module (for a package: its __init__)
    file: str  # importer's file, relative to the repository
    line: int
    where: str  # "module" | "function" | "type-checking"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """module name -> file, for every .py under root/package (symlinked folders followed: kernels/)."""
    modules: dict[str, Path] = {}
    for folder, dirs, files in os.walk(root / package, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under `node`, with where it runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, "function")
        elif isinstance(child, ast.If) and where == "module" and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "module")
        else:
            yield from _walk(child, where)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: Path, package: str) -> tuple[dict[str, Path], list[Import], list[Import]]:
    """(modules, imports of the package's own modules, third-party imports) of every module."""
    modules = package_modules(root, package)
    own: list[Import] = []
    other: list[Import] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        rel = str(path.relative_to(root))
        for node, where in _walk(ast.parse(path.read_text(), str(path)), "module"):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _absolute(node, module, is_package)
                # `from pkg import sub` imports the submodule pkg.sub; `from mod import name` the module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for name in dict.fromkeys(names):
                if name == package or name.startswith(package + "."):
                    target = name
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    own.append(Import(module, target, rel, node.lineno, where))
                elif name and not name.startswith("."):
                    other.append(Import(module, name, rel, node.lineno, where))
    return modules, own, other


def import_graph(modules: dict[str, Path], own: list[Import]) -> dict[str, dict[str, Import]]:
    """importer -> {imported module: the first import statement that makes the edge}."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in own:
        if imp.target != imp.importer:
            graph[imp.importer].setdefault(imp.target, imp)
        # importing a.b.c runs a/__init__ and a/b/__init__ first (already running for a module inside them)
        parts = imp.target.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules and parent != imp.importer and not imp.importer.startswith(parent + "."):
                graph[imp.importer].setdefault(parent, imp)
    return graph


def cycles(graph: dict[str, dict[str, Import]]) -> list[list[Import]]:
    """One cycle (as the import statements along it) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        members = set(component)
        if len(members) < 2:
            continue
        # the shortest way back to the component's first module, breadth first inside the component
        start = min(members)
        paths: dict[str, list[Import]] = {start: []}
        queue = [start]
        cycle: list[Import] | None = None
        while queue and cycle is None:
            v = queue.pop(0)
            for w, imp in sorted(graph[v].items()):
                if w == start:
                    cycle = paths[v] + [imp]
                    break
                if w in members and w not in paths:
                    paths[w] = paths[v] + [imp]
                    queue.append(w)
        assert cycle is not None
        found.append(cycle)
    return found


def describe(cycle: list[Import]) -> str:
    return "\n".join(f"  {imp.importer} -> {imp.target}  ({imp.file}:{imp.line}, {imp.where})" for imp in cycle)


_LAYER_LINE = re.compile(r"^layer\s+(\d+)\s+(.*)$")


def design_layers(design: Path) -> dict[str, int]:
    """package (a directory or module directly under memfit_gpu/) -> its layer, from the `layer N  names`
    lines of docs/concepts/design.md's module graph (names end where `->` or `(` begins)."""
    layers: dict[str, int] = {}
    for line in design.read_text().splitlines():
        match = _LAYER_LINE.match(line.strip())
        if match:
            names = re.split(r"->|\(", match.group(2), maxsplit=1)[0].split()
            for name in names:
                layers[name] = int(match.group(1))
    return layers


def top_package(module: str, package: str) -> str:
    """memfit_gpu.data.jsonl -> data; memfit_gpu.render -> render; memfit_gpu -> '' (the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package else ""


def upward_imports(own: list[Import], layers: dict[str, int], package: str) -> list[Import]:
    """Imports from a module into a package of a higher layer (the root package counts as none)."""
    found = []
    for imp in own:
        source, target = top_package(imp.importer, package), top_package(imp.target, package)
        if source and target and source != target and layers[target] > layers[source]:
            found.append(imp)
    return found
