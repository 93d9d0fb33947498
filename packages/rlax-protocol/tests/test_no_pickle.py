"""Nothing is ever pickled (docs/design.md, "Messages: the wire protocol"): scan every Python source of the monorepo.

The scan reads the syntax tree, so prose in comments or docstrings is not flagged,
while imports of pickling modules, `send_pyobj`/`recv_pyobj`, pandas' `read_pickle`/
`to_pickle`, `allow_pickle=True` and dynamic imports of a pickling module are.

This is the one place the rule is enforced: it reads every Python file of the checkout
(packages' sources, tests and benchmarks, kernels, tools, the root's tests and
benchmarks, noxfile.py), where an import contract sees only the packages' sources and
ruff's S301 only calls such as `pickle.loads`, which need an import found here first.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
# Folders that hold no source of the project: virtual environments, caches, run outputs.
SKIPPED_FOLDERS = {"build", "runs", "bench-results", "node_modules", "__pycache__"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "jsonpickle"}
PICKLE_NAMES = PICKLE_MODULES | {
    "send_pyobj",
    "recv_pyobj",
    "send_serialized",
    "recv_serialized",
    "read_pickle",
    "to_pickle",
}


def pickling_uses(source: str, filename: str) -> list[str]:
    """`file:line: what` for every pickling construct in `source`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        what = None
        if isinstance(node, ast.Import):
            hits = [a.name for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
            what = f"import {', '.join(hits)}" if hits else None
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PICKLE_MODULES:
            what = f"from {node.module} import"
        elif isinstance(node, ast.ImportFrom):
            hits = [a.name for a in node.names if a.name in PICKLE_NAMES]
            what = f"from {node.module} import {', '.join(hits)}" if hits else None
        elif isinstance(node, ast.Attribute) and node.attr in PICKLE_NAMES:
            what = f".{node.attr}"
        elif isinstance(node, ast.Name) and node.id in PICKLE_NAMES:
            what = node.id
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                what = "allow_pickle=True"
        elif isinstance(node, ast.Call) and any(
            isinstance(a, ast.Constant) and a.value in PICKLE_MODULES for a in node.args
        ):
            what = "dynamic import of a pickling module"
        if what:
            found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")
    return found


def test_scanner_catches_every_form() -> None:
    snippets = [
        "import pickle",
        "import dill as d",
        "from cloudpickle import dumps",
        "sock.send_pyobj(x)",
        "x = s.recv_pyobj()",
        "np.load(f, allow_pickle=True)",
        "importlib.import_module('pickle')",
        "from zmq import Socket, send_pyobj",
        "frame = pd.read_pickle(path)",
        "frame.to_pickle(path)",
        "import jsonpickle",
    ]
    for snippet in snippets:
        assert pickling_uses(snippet, "s.py"), snippet
    assert not pickling_uses(
        '"""Nothing is pickled; no pickle here."""\nnp.load(f, allow_pickle=False)', "ok.py"
    )


def python_sources() -> list[pathlib.Path]:
    """Every .py file of the checkout outside hidden folders (.git, .venv, .nox) and `SKIPPED_FOLDERS`."""
    found: list[pathlib.Path] = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in SKIPPED_FOLDERS)
        found += [pathlib.Path(folder) / name for name in sorted(files) if name.endswith(".py")]
    return found


def test_the_scan_reads_every_part_of_the_monorepo() -> None:
    scanned = {path.relative_to(ROOT).parts[0] for path in python_sources()}
    assert {"packages", "kernels", "tests", "tools", "benchmarks", "noxfile.py"} <= scanned, scanned
    assert not any(part.startswith(".") for path in python_sources() for part in path.relative_to(ROOT).parts)


def scan() -> tuple[int, list[str]]:
    """(files scanned, offenders) over every Python source of the monorepo but this file."""
    this = pathlib.Path(__file__).resolve()
    offenders: list[str] = []
    scanned = 0
    for path in python_sources():
        if path.resolve() == this:
            continue
        scanned += 1
        offenders += pickling_uses(path.read_text(errors="replace"), str(path.relative_to(ROOT)))
    return scanned, offenders


def test_no_pickle_anywhere() -> None:
    # In a fresh interpreter: in a long-lived test worker CPython 3.11's parser once raised
    # "SystemError: AST constructor recursion depth mismatch" on an ordinary file (after
    # other tests there had recursed deeply), which says nothing about the sources.
    code = f"import json, runpy; print(json.dumps(runpy.run_path({str(pathlib.Path(__file__).resolve())!r})['scan']()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    scanned, offenders = json.loads(done.stdout.splitlines()[-1])
    assert scanned > 0, f"no Python source found under {ROOT}"
    assert not offenders, (
        "pickling is forbidden (docs/design.md, Messages: the wire protocol):\n" + "\n".join(offenders)
    )
