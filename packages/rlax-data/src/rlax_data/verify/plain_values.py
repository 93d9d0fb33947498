"""Plain values: the only form in which data crosses the sandbox boundary.

A value is *plain* when it is built from exactly these built-in types (subclasses are
refused, so no user-defined `__eq__`, `__hash__` or `__repr__` ever runs on the judging
side): None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset.
`to_plain` turns such a value into JSON-ready data (lists stay JSON arrays; the other
containers and non-finite floats become one-key objects such as `{"tuple": [...]}`), and
`from_plain` rebuilds it strictly: anything else is a `ValueError`.

This module uses only the standard library and no relative imports: its source is also
run inside the sandbox (see `_harness.py`), so both sides share one encoding. There it
may run under another interpreter (`sandbox.python`) and must start fast: `typing` is
imported for the type checker only, and annotations that name it are strings.
"""

import math

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 200

_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex", "float")


def _float_to_plain(value: float) -> "float | dict[str, str]":
    if math.isfinite(value):
        return value
    return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def to_plain(value: "Any", depth: int = 0) -> object:
    """JSON-ready data for a plain `value`; `TypeError` names the first type that is not."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value
    if kind is float:
        return _float_to_plain(value)
    if kind is list:
        return [to_plain(item, depth + 1) for item in value]
    if kind is tuple:
        return {"tuple": [to_plain(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[to_plain(k, depth + 1), to_plain(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {kind.__name__: [to_plain(item, depth + 1) for item in value]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [_float_to_plain(value.real), _float_to_plain(value.imag)]}
    raise TypeError(
        f"returned a value of type {kind.__module__}.{kind.__qualname__}; "
        "only built-in values (None, bool, int, float, complex, str, bytes, list, tuple, dict, "
        "set, frozenset, without subclasses) can be checked"
    )


def _float_from_plain(data: object) -> float:
    if type(data) is float:
        return data
    if type(data) is int:
        return float(data)
    if type(data) is dict and len(data) == 1 and data.get("float") in ("nan", "inf", "-inf"):
        return float(data["float"])
    raise ValueError(f"not a float: {data!r:.80}")


def from_plain(data: "Any", depth: int = 0) -> "Any":
    """The value that `to_plain` encoded as `data` (decoded JSON); `ValueError` otherwise."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind is bool or kind is str or kind is int or kind is float:
        return data
    if kind is list:
        return [from_plain(item, depth + 1) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"not a plain value: {data!r:.80}")
    ((tag, body),) = data.items()
    if tag == "float":
        return _float_from_plain(data)
    if tag not in _TAGS:
        raise ValueError(f"unknown tag {tag!r:.40}")
    if tag == "bytes":
        if type(body) is not str:
            raise ValueError("bytes must be a hex string")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"{tag} must hold a list")
    if tag == "complex":
        if len(body) != 2:
            raise ValueError("complex must hold [real, imag]")
        return complex(_float_from_plain(body[0]), _float_from_plain(body[1]))
    if tag == "dict":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("dict items must be [key, value] pairs")
            out[from_plain(pair[0], depth + 1)] = from_plain(pair[1], depth + 1)
        return out
    items = [from_plain(item, depth + 1) for item in body]
    if tag == "tuple":
        return tuple(items)
    return set(items) if tag == "set" else frozenset(items)
