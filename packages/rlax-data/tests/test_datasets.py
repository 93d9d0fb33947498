from __future__ import annotations

import json

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlax_data import (
    CallCase,
    CodeTests,
    DatasetError,
    IOCase,
    Message,
    Record,
    load_dataset,
    load_jsonl,
    load_parquet,
    write_jsonl,
    write_parquet,
)


def _rows() -> list[dict]:
    return [
        {"id": "a", "prompt": "1+1=", "answer": "2", "task": "arithmetic"},
        {
            "id": "b",
            "messages": [{"role": "user", "content": "hi"}],
            "answer": "x",
            "metadata": {"k": [1, 2]},
        },
        {
            "id": "c",
            "prompt": "write add",
            "tests": {
                "entry_point": "add",
                "calls": [{"args": [1, 2], "expected": 3}],
                "io": [{"stdout": "3"}],
            },
        },
    ]


def _write_lines(path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def test_jsonl_round_trip(tmp_path):
    p = tmp_path / "d.jsonl"
    _write_lines(p, [json.dumps(r) for r in _rows()])
    ds = load_jsonl(p)
    assert [r.id for r in ds] == ["a", "b", "c"]
    assert ds[1].messages == [Message(role="user", content="hi")]
    assert ds[2].tests == CodeTests(
        entry_point="add", calls=[CallCase(args=[1, 2], expected=3)], io=[IOCase(stdout="3")]
    )
    out = write_jsonl(ds, tmp_path / "out.jsonl")
    assert load_jsonl(out).records == ds.records
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed away


def test_parquet_round_trip(tmp_path):
    recs = [
        Record(id="a", prompt="1+1=", answer="2", metadata={"x": 1}),
        Record(id="b", prompt="p", answer="q"),
    ]
    p = write_parquet(recs, tmp_path / "d.parquet")
    assert load_dataset(p).records == recs


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    _write_lines(p, [json.dumps(_rows()[0]), '{"id": "z", "prompt": ', json.dumps(_rows()[2])])
    with pytest.raises(DatasetError) as ei:
        load_jsonl(p)
    assert ei.value.line == 2 and ei.value.path == str(p)
    assert f"{p}:2:" in str(ei.value) and "malformed JSON" in str(ei.value)


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": "x", "answer": "1"}, "id"),
        ({"id": "q", "answer": "1"}, "prompt"),
        ({"id": "q", "prompt": "x"}, "answer"),
        ({"id": "q", "prompt": 5, "answer": "1"}, "prompt"),
        ({"id": "q", "prompt": "x", "tests": {"io": [{"stdin": "1"}]}}, "tests.io[0].stdout"),
        ({"id": "q", "prompt": "x", "tests": {"calls": [{"args": []}]}}, "tests.entry_point"),
        ({"id": "q", "prompt": "x", "answer": "1", "colour": "red"}, "colour"),
    ],
)
def test_missing_or_wrong_field_names_file_line_field(tmp_path, row, field):
    p = tmp_path / "bad.jsonl"
    _write_lines(p, [json.dumps(_rows()[0]), json.dumps(_rows()[1]), json.dumps(row)])
    with pytest.raises(DatasetError) as ei:
        load_jsonl(p)
    err = ei.value
    assert err.line == 3 and err.path == str(p)
    assert err.field == field
    assert str(err).startswith(f"{p}:3:")
    assert f"`{field}`" in str(err)


def test_skip_mode_counts_bad_rows(tmp_path):
    p = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in _rows()]
    lines.insert(1, "not json")
    lines.insert(3, json.dumps({"id": "a", "prompt": "dup", "answer": "1"}))
    lines.append(json.dumps({"id": "n"}))
    _write_lines(p, lines)
    ds = load_jsonl(p, on_error="skip")
    assert [r.id for r in ds] == ["a", "b", "c"]
    assert [(e.line, e.field) for e in ds.skipped] == [(2, None), (4, "id"), (6, "prompt")]
    assert "duplicate id" in str(ds.skipped[1])


def test_parquet_wrong_schema_names_file_row_field(tmp_path):
    p = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2]), "prompt": ["a", "b"], "answer": ["1", "2"]}), p)
    with pytest.raises(DatasetError) as ei:
        load_parquet(p)
    assert (ei.value.path, ei.value.line, ei.value.field) == (str(p), 1, "id")
    assert "int64" in str(ei.value) and str(p) in str(ei.value)

    q = tmp_path / "noid.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"]}), q)
    with pytest.raises(DatasetError, match="field `id`"):
        load_parquet(q)


def test_parquet_bad_row_names_row(tmp_path):
    p = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b", "c"], "prompt": ["x", None, "z"], "answer": ["1", "2", "3"]}), p
    )
    with pytest.raises(DatasetError) as ei:
        load_parquet(p)
    assert (ei.value.line, ei.value.field) == (2, "prompt")
    ds = load_parquet(p, on_error="skip")
    assert [r.id for r in ds] == ["a", "c"] and len(ds.skipped) == 1


def test_not_a_parquet_file(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"nope")
    with pytest.raises(DatasetError, match="not a readable Parquet"):
        load_parquet(p)


def test_record_rules():
    with pytest.raises(ValueError, match="exactly one of"):
        Record(id="x", prompt="a", messages=[Message(role="user", content="b")], answer="1")
    assert (
        msgspec.json.decode(msgspec.json.encode(Record(id="x", prompt="a", answer="1")), type=Record).id
        == "x"
    )
    with pytest.raises(ValueError, match="render it"):
        Record(id="x", messages=[Message(role="user", content="b")], answer="1").prompt_text()
