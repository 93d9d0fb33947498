"""Fails when modules of the RLAX packages import each other in a circle.

Builds the import graph of every package's `src` with `ast` (nothing is imported): every
`import` and `from ... import` counts, those inside functions included, since an import
deferred into a function hides a cycle without removing it. Imports under
`if TYPE_CHECKING:` never run and are left out. `from package import name` points at the
submodule `package.name` when that file exists, else at the package's `__init__`.
Importing a submodule runs its parent package's `__init__` too, but that edge is implicit
and left out: counting it would make every `__init__` that gathers its submodules' names a
cycle with each of them. Prints each cycle, module by module, and exits 1.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_ROOTS = [*sorted((ROOT / "packages").glob("*/src")), ROOT / "kernels" / "src"]


def modules_under(src: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> file, for every `.py` file of the packages in `src`."""
    found: dict[str, pathlib.Path] = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth (functions and classes included)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = graph[module]
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
                continue
            source = _absolute(module, path.name == "__init__.py", node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    targets.add(submodule)
                elif source in modules:
                    targets.add(source)
        targets.discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """For every strongly connected component of more than one module: one cycle through it
    (a closed path of modules) and all its modules (Tarjan's algorithm, iterative: deep graphs do not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [(_closed_path(graph, set(c)), c) for c in components]


def _closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path from the component's first module back to itself, inside the component."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def main() -> int:
    modules: dict[str, pathlib.Path] = {}
    for src in SOURCE_ROOTS:
        if src.is_dir():
            modules.update(modules_under(src))
    found = cycles(import_graph(modules))
    for cycle, component in found:
        print("import cycle: " + " -> ".join(cycle), file=sys.stderr)
        if len(component) > len(cycle) - 1:
            print(f"  (the modules that import each other: {', '.join(component)})", file=sys.stderr)
    if found:
        print(f"{len(found)} import cycle(s) among {len(modules)} modules", file=sys.stderr)
        return 1
    print(f"no import cycle among {len(modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
