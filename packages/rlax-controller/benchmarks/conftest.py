"""Benchmark helpers of this folder (`launched_runs`) importable by its benchmarks."""

from __future__ import annotations

import pathlib
import sys

# --import-mode=importlib does not put benchmark folders on sys.path; our helpers live here.
_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
