"""Nothing is ever pickled (DESIGN.md §3): scan every Python source of the monorepo.

The scan reads the syntax tree, so prose in comments or docstrings is not flagged,
while imports of pickling modules, `send_pyobj`/`recv_pyobj`, `allow_pickle=True` and
dynamic imports of a pickling module are.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCANNED = [ROOT / "packages", ROOT / "kernels", ROOT / "tests", ROOT / "tools"]
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve"}
PICKLE_NAMES = PICKLE_MODULES | {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}


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
    ]
    for snippet in snippets:
        assert pickling_uses(snippet, "s.py"), snippet
    assert not pickling_uses(
        '"""Nothing is pickled; no pickle here."""\nnp.load(f, allow_pickle=False)', "ok.py"
    )


def scan() -> tuple[int, list[str]]:
    """(files scanned, offenders) over every Python source of the monorepo but this file."""
    this = pathlib.Path(__file__).resolve()
    offenders: list[str] = []
    scanned = 0
    for folder in SCANNED:
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            if path.resolve() == this or {".venv", ".nox", "build"} & set(path.parts):
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
    assert not offenders, "pickling is forbidden (DESIGN.md §3):\n" + "\n".join(offenders)
