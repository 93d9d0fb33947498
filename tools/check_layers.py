"""Checks that every package's imports point down the layer graph (DESIGN.md §2).

Reads each package's source with `ast` (nothing is imported) and reports, by file and
line, an import of a package that is not among its allowed dependencies. JAX and its
libraries are forbidden in the JAX-free packages.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# package import name -> (source folder, RLAX packages it may import)
ALLOWED: dict[str, tuple[str, set[str]]] = {
    "rlax_protocol": ("packages/rlax-protocol/src", set()),
    "rlax_core": ("packages/rlax-core/src", {"rlax_protocol"}),
    "rlax_paramserver": ("packages/rlax-paramserver/src", {"rlax_protocol"}),
    "rlax_kernels": ("kernels/src", set()),
    "rlax_model": ("packages/rlax-model/src", {"rlax_protocol", "rlax_core"}),
    "rlax_data": ("packages/rlax-data/src", {"rlax_protocol", "rlax_core"}),
    "rlax_inference": (
        "packages/rlax-inference/src",
        {"rlax_model", "rlax_kernels", "rlax_protocol", "rlax_paramserver", "rlax_core", "rlax_data"},
    ),
    "rlax_trainer": (
        "packages/rlax-trainer/src",
        {"rlax_model", "rlax_protocol", "rlax_paramserver", "rlax_core", "rlax_data"},
    ),
    # The controller node installs no JAX: no model, engine, kernels or trainer.
    "rlax_controller": (
        "packages/rlax-controller/src",
        {"rlax_protocol", "rlax_core", "rlax_data", "rlax_paramserver"},
    ),
}
JAX_FREE = {"rlax_protocol", "rlax_core", "rlax_paramserver", "rlax_data", "rlax_controller"}
JAX_LIBS = {"jax", "jaxlib", "flax", "optax", "orbax", "torch"}
FORBIDDEN_ANYWHERE = {"pickle", "cloudpickle", "dill"}


def imported_roots(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def main() -> int:
    problems: list[str] = []
    for package, (src, allowed) in ALLOWED.items():
        folder = ROOT / src / package
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, root in imported_roots(tree):
                where = f"{path.relative_to(ROOT)}:{line}"
                if root.startswith("rlax_") and root != package and root not in allowed:
                    problems.append(f"{where}: {package} may not import {root} (layering)")
                if package in JAX_FREE and root in JAX_LIBS:
                    problems.append(f"{where}: {package} must stay JAX-free but imports {root}")
                if root in FORBIDDEN_ANYWHERE:
                    problems.append(f"{where}: {root} is forbidden (nothing is ever pickled)")
    for problem in problems:
        print(problem)
    print(f"layer check: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
