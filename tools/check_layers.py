"""Checks that every RLAX package imports only the RLAX packages its pyproject.toml declares.

The layer graph is written once, as each package's `dependencies`: that list is what a
node installs (`tools/node_installs.py` builds each role's environment from it), so an
import of an undeclared RLAX package works in the editable checkout and fails on a node.
import-linter cannot see pyproject.toml, and the rules it does hold (`.importlinter`:
no JAX on the JAX-free nodes, the packages that must never depend on one another, also
through indirect imports) are not repeated here. Pickling is caught by
packages/rlax-protocol/tests/test_no_pickle.py.

Reads each package's source with `ast` (nothing is imported) and reports an undeclared
import by file and line.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = [
    "kernels",
    *sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("packages/*/pyproject.toml")),
]


def import_name(distribution: str) -> str:
    """`rlax-paramserver` -> `rlax_paramserver`."""
    return re.sub(r"[-.]+", "_", distribution).lower()


def declared_packages(folder: pathlib.Path) -> tuple[str, set[str]]:
    """(import name, RLAX import names it declares as dependencies) of the package in `folder`."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    declared = {
        import_name(re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]) for spec in project["dependencies"]
    }
    return import_name(project["name"]), {name for name in declared if name.startswith("rlax_")}


def imported_roots(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def undeclared_imports(folder: pathlib.Path) -> list[str]:
    """`file:line: ...` for every import of an RLAX package `folder`'s package does not declare."""
    package, allowed = declared_packages(folder)
    source = folder / "src" / package
    if not source.is_dir():
        return [f"{folder.relative_to(ROOT)}: no source folder src/{package}"]
    problems: list[str] = []
    for path in sorted(source.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, root in imported_roots(tree):
            if root.startswith("rlax_") and root != package and root not in allowed:
                problems.append(
                    f"{path.relative_to(ROOT)}:{line}: {package} imports {root}, "
                    f"which {folder.relative_to(ROOT)}/pyproject.toml does not declare"
                )
    return problems


def main() -> int:
    problems = [p for folder in PACKAGE_FOLDERS if (ROOT / folder / "pyproject.toml").exists()
                for p in undeclared_imports(ROOT / folder)]  # fmt: skip
    for problem in problems:
        print(problem)
    print(f"layer check: {len(problems)} problem(s) in {len(PACKAGE_FOLDERS)} packages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
