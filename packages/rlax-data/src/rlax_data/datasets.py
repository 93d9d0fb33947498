"""Typed dataset records and their JSONL / Parquet loaders and writers.

A record is one prompt (plain text or chat messages) with what a verifier needs to
score a completion for it: a reference answer, or code tests. Loading validates every
row; a bad row raises a `DatasetError` naming the file, line (or Parquet row) and
field, or, with `on_error="skip"`, is skipped and counted in `Dataset.skipped`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlax_protocol.atomic_files import atomic_write

__all__ = [
    "CallCase",
    "CodeTests",
    "Dataset",
    "DatasetError",
    "IOCase",
    "Message",
    "Record",
    "load_dataset",
    "load_jsonl",
    "load_parquet",
    "write_jsonl",
    "write_parquet",
]


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat turn."""

    role: str
    content: str


class IOCase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A stdin/stdout test: the program reads `stdin` and must print `stdout`
    (compared after stripping trailing whitespace on each line)."""

    stdin: str = ""
    stdout: str


class CallCase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A function-call test: `entry_point(*args, **kwargs) == expected` (JSON values)."""

    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    expected: Any = None


class CodeTests(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a code completion is tested.

    The program is `prefix + completion`. Then, in this order and each only if given:
    `script` (assert-style tests, such as HumanEval's `check(candidate)`; any exception
    fails it) runs after `prefix` in a sandbox of its own, with `entry_point` bound to a
    stand-in that calls the program (in its sandbox) and returns the plain value it
    sent back; each `calls` case calls `entry_point` in the sandbox and
    compares its plain return value with `expected` outside it; each `io` case runs the
    program with its stdin.
    """

    prefix: str = ""
    script: str = ""
    entry_point: str | None = None
    io: list[IOCase] = []
    calls: list[CallCase] = []
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.script or self.io or self.calls):
            raise ValueError("field `tests`: needs at least one of `script`, `io`, `calls`")
        if self.calls and not self.entry_point:
            raise ValueError("field `tests.entry_point`: required when `tests.calls` is given")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"field `tests.timeout_s`: must be > 0, got {self.timeout_s!r}")

    @property
    def num_cases(self) -> int:
        return (1 if self.script else 0) + len(self.calls) + len(self.io)


class Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One prompt with what its verifier needs.

    Exactly one of `prompt` / `messages`; at least one of `answer` / `tests`.
    `task` names the verifier that scores it (a key of a `RoutingVerifier`).
    """

    id: str
    prompt: str | None = None
    messages: list[Message] | None = None
    answer: str | None = None
    tests: CodeTests | None = None
    task: str | None = None
    metadata: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("field `id`: must be a non-empty string")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("field `prompt`: give exactly one of `prompt` or `messages`")
        if self.messages is not None and not self.messages:
            raise ValueError("field `messages`: must not be empty")
        if self.answer is None and self.tests is None:
            raise ValueError("field `answer`: give `answer` or `tests` (or both)")

    def prompt_text(self) -> str:
        """The plain-text prompt; chat records need a chat template, so they raise."""
        if self.prompt is None:
            raise ValueError(f"record {self.id!r}: has chat `messages`, not a text `prompt`; render it")
        return self.prompt


class DatasetError(ValueError):
    """A bad row: names the file, the line (JSONL, 1-based) or row (Parquet, 1-based) and the field."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, field: str | None, reason: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        what = f" field `{field}`:" if field else ""
        super().__init__(f"{where}:{what} {reason}")


@dataclass
class Dataset(Sequence[Record]):
    """Records loaded from one or more files, with the rows that were skipped."""

    records: list[Record]
    skipped: list[DatasetError] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Record:  # type: ignore[override]
        return self.records[i]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)


_AT = re.compile(r"^(?P<msg>.*?) - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"(?:missing required|contains unknown) field `(?P<name>[^`]+)`")
_FIELD_PREFIX = re.compile(r"^field `(?P<name>[^`]+)`: (?P<msg>.*)$")


def _split_validation_error(err: Exception) -> tuple[str | None, str]:
    """Turn a msgspec error message into (field path, reason)."""
    text = str(err)
    path = ""
    m = _AT.match(text)
    if m:
        text, path = m.group("msg"), m.group("path")
    m = _FIELD_PREFIX.match(text)
    if m:
        name, text = m.group("name"), m.group("msg")
        path = name if not path else f"{path}.{name.split('.')[-1]}"
        return path, text
    m = _MISSING.search(text)
    if m:
        name = m.group("name")
        return (f"{path}.{name}" if path else name), text
    return (path or None), text


def _decode_row(raw: bytes | dict[str, Any], path: str, line: int) -> Record:
    try:
        if isinstance(raw, dict):
            return msgspec.convert(raw, Record)
        return msgspec.json.decode(raw, type=Record)
    except msgspec.ValidationError as e:  # a subclass of DecodeError, so first
        fld, reason = _split_validation_error(e)
        raise DatasetError(path, line, fld, reason) from None
    except msgspec.DecodeError as e:
        raise DatasetError(path, line, None, f"malformed JSON: {e}") from None


OnError = Literal["raise", "skip"]


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error: must be 'raise' or 'skip', got {on_error!r}")


def load_jsonl(path: str | os.PathLike[str], *, on_error: OnError = "raise") -> Dataset:
    """Load one JSONL file of records (blank lines are ignored).

    With `on_error="skip"` a bad line is skipped and its `DatasetError` kept in `skipped`.
    Duplicate ids within the file are an error either way (they break resumable streams).
    """
    _check_on_error(on_error)
    p = str(path)
    records: list[Record] = []
    skipped: list[DatasetError] = []
    seen: dict[str, int] = {}
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = _decode_row(raw, p, lineno)
                if rec.id in seen:
                    raise DatasetError(
                        p, lineno, "id", f"duplicate id {rec.id!r} (first on line {seen[rec.id]})"
                    )
            except DatasetError as e:
                if on_error == "raise":
                    raise
                skipped.append(e)
                continue
            seen[rec.id] = lineno
            records.append(rec)
    return Dataset(records, skipped, source=p)


# Columns whose values are written to Parquet as JSON text (free-form or mixed-type values).
_JSON_COLUMNS = ("metadata", "tests")
# Parquet column -> the Arrow types we accept for it (struct/list columns are checked per row).
_PARQUET_SCALAR_COLUMNS = {"id": "string", "prompt": "string", "answer": "string", "task": "string"}


def load_parquet(path: str | os.PathLike[str], *, on_error: OnError = "raise") -> Dataset:
    """Load a Parquet file of records.

    The schema is checked first: `id` must exist and the string columns (`id`, `prompt`,
    `answer`, `task`) must be string-typed; a wrong schema raises naming the file, row 1
    and the field. Rows are then validated one by one (rows are numbered from 1).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_on_error(on_error)
    p = str(path)
    try:
        table = pq.read_table(p)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(p, None, None, f"not a readable Parquet file: {e}") from None
    schema = table.schema
    if "id" not in schema.names:
        raise DatasetError(p, 1, "id", f"column missing from the Parquet schema (columns: {schema.names})")
    known = set(Record.__struct_fields__)
    for name in schema.names:
        if name not in known:
            raise DatasetError(p, 1, name, f"unknown column; expected a subset of {sorted(known)}")
    for name, want in _PARQUET_SCALAR_COLUMNS.items():
        if name in schema.names:
            typ = schema.field(name).type
            if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
                raise DatasetError(p, 1, name, f"column has Arrow type {typ}, expected {want}")
    records: list[Record] = []
    skipped: list[DatasetError] = []
    seen: dict[str, int] = {}
    for rowno, row in enumerate(table.to_pylist(), start=1):
        # Parquet has no "absent": a null optional column means the field is not given.
        row = {k: v for k, v in row.items() if v is not None or k == "id"}
        bad = None
        for name in _JSON_COLUMNS:
            if isinstance(row.get(name), str):
                # Stored as JSON strings so that heterogeneous values fit one Arrow column.
                try:
                    row[name] = msgspec.json.decode(row[name])
                except msgspec.DecodeError as e:
                    bad = DatasetError(p, rowno, name, f"not valid JSON: {e}")
                    break
        if bad is not None:
            if on_error == "raise":
                raise bad
            skipped.append(bad)
            continue
        try:
            rec = _decode_row(row, p, rowno)
            if rec.id in seen:
                raise DatasetError(p, rowno, "id", f"duplicate id {rec.id!r} (first in row {seen[rec.id]})")
        except DatasetError as e:
            if on_error == "raise":
                raise
            skipped.append(e)
            continue
        seen[rec.id] = rowno
        records.append(rec)
    return Dataset(records, skipped, source=p)


def load_dataset(path: str | os.PathLike[str], *, on_error: OnError = "raise") -> Dataset:
    """Load by suffix: `.jsonl` / `.json` (one record per line) or `.parquet`."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return load_jsonl(path, on_error=on_error)
    if suffix in (".parquet", ".pq"):
        return load_parquet(path, on_error=on_error)
    raise DatasetError(path, None, None, f"unknown dataset suffix {suffix!r}; use .jsonl or .parquet")


def write_jsonl(records: Iterable[Record], path: str | os.PathLike[str]) -> Path:
    """Write records as JSONL, atomically (temp file, fsync, rename)."""
    enc = msgspec.json.Encoder()

    def write(f: Any) -> None:
        for rec in records:
            f.write(enc.encode(rec))
            f.write(b"\n")

    return atomic_write(path, write)


def write_parquet(records: Iterable[Record], path: str | os.PathLike[str]) -> Path:
    """Write records as Parquet, atomically; `metadata` and `tests` are JSON string columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for rec in records:
        row = msgspec.to_builtins(rec)
        row["metadata"] = msgspec.json.encode(rec.metadata).decode()
        row["tests"] = None if rec.tests is None else msgspec.json.encode(rec.tests).decode()
        rows.append(row)
    table = pa.Table.from_pylist(rows)
    return atomic_write(path, lambda f: pq.write_table(table, f))
