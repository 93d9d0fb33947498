from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

# --import-mode=importlib does not put test folders on sys.path; our helpers live here.
_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def stamped_tree(version: int, *, layers: int = 3, hidden: int = 32) -> dict[str, Any]:
    """A small model whose every tensor encodes `version`, so a mixed-up pull is detectable."""
    tree: dict[str, Any] = {"embed": np.full((50, hidden), version, dtype=np.float32), "layers": {}}
    for i in range(layers):
        tree["layers"][str(i)] = {
            "attn": {"q": np.full((hidden, hidden), version + i, dtype=ml_dtypes.bfloat16)},
            "mlp": {"up": np.full((hidden, 2 * hidden), version * 10 + i, dtype=np.float32)},
            "count": np.array(version, dtype=np.int32),
        }
    return tree


def check_stamped(tree: dict[str, Any], version: int) -> None:
    assert np.all(tree["embed"] == version)
    for i, layer in tree["layers"].items():
        assert np.all(layer["attn"]["q"] == np.asarray(version + int(i), dtype=ml_dtypes.bfloat16))
        assert np.all(layer["mlp"]["up"] == version * 10 + int(i))
        assert int(layer["count"]) == version


@pytest.fixture
def stamp() -> tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any], int], None]]:
    return stamped_tree, check_stamped
