from __future__ import annotations

import json
import random

import pytest

from rlax_data import DynamicFilter, PromptStream, Record, StreamSource


def _recs(prefix: str, n: int) -> list[Record]:
    return [Record(id=f"{prefix}{i}", prompt=f"{prefix}{i}", answer="x") for i in range(n)]


def _sources(epochs=None):
    return [
        StreamSource("a", _recs("a", 7), weight=3.0, epochs=epochs),
        StreamSource("b", _recs("b", 5), weight=1.0, epochs=epochs),
        StreamSource("c", _recs("c", 3), weight=0.5, epochs=None if epochs is None else epochs + 1),
    ]


def test_resume_at_random_cut_points_gives_the_same_sequence():
    reference = [r.id for r in PromptStream(_sources(), seed=11).take(400)]
    rng = random.Random(0)
    for _ in range(25):
        cut = rng.randrange(0, 400)
        s = PromptStream(_sources(), seed=11)
        head = [r.id for r in s.take(cut)]
        state = json.loads(json.dumps(s.state_dict()))  # JSON-able and small
        assert len(json.dumps(state)) < 400
        resumed = PromptStream(_sources(), seed=11)
        resumed.load_state_dict(state)
        assert head + [r.id for r in resumed.take(400 - cut)] == reference


def test_resume_chain_of_many_restarts():
    reference = [r.id for r in PromptStream(_sources(epochs=3), seed=5)]
    out: list[str] = []
    state = None
    rng = random.Random(1)
    while True:
        s = PromptStream(_sources(epochs=3), seed=5)
        if state is not None:
            s.load_state_dict(state)
        got = s.take(rng.randrange(1, 9))
        if not got:
            break
        out += [r.id for r in got]
        state = s.state_dict()
    assert out == reference


def test_epochs_weights_and_shuffling():
    ids = [r.id for r in PromptStream(_sources(epochs=2), seed=3)]
    # finite epochs: every record exactly `epochs` times, then the stream ends
    assert len(ids) == 2 * 7 + 2 * 5 + 3 * 3
    for prefix, n, ep in (("a", 7, 2), ("b", 5, 2), ("c", 3, 3)):
        for i in range(n):
            assert ids.count(f"{prefix}{i}") == ep
    first_epoch_a = [i for i in ids if i.startswith("a")][:7]
    assert sorted(first_epoch_a) == sorted(f"a{i}" for i in range(7))
    assert first_epoch_a != [f"a{i}" for i in range(7)]  # shuffled
    # weights: over a long unbounded run the mix follows 3 : 1 : 0.5
    long = [r.id[0] for r in PromptStream(_sources(), seed=9).take(9000)]
    assert long.count("a") / len(long) == pytest.approx(3 / 4.5, abs=0.02)
    assert long.count("c") / len(long) == pytest.approx(0.5 / 4.5, abs=0.02)
    assert [r.id for r in PromptStream(_sources(), seed=9, shuffle=False).take(0)] == []
    assert PromptStream(_sources(), seed=9).take(50) != PromptStream(_sources(), seed=10).take(50)


def test_state_mismatch_names_field():
    s = PromptStream(_sources(), seed=1)
    s.take(5)
    st = s.state_dict()
    with pytest.raises(ValueError, match="field `seed`"):
        PromptStream(_sources(), seed=2).load_state_dict(st)
    other = [StreamSource("a", _recs("a", 8)), *_sources()[1:]]
    with pytest.raises(ValueError, match="sources.a.size"):
        PromptStream(other, seed=1).load_state_dict(st)
    with pytest.raises(ValueError, match="field `sources`"):
        PromptStream(_sources()[:2], seed=1).load_state_dict(st)
    with pytest.raises(ValueError, match="weight"):
        StreamSource("z", _recs("z", 1), weight=0)


def test_dynamic_filter_drops_all_equal_groups_and_counts():
    f = DynamicFilter()
    groups = [[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5], [1, 0], [0, 0]]
    assert f(groups) == [[0, 1, 0], [1, 0]]
    st = f.stats()
    assert st["seen"] == 6 and st["kept"] == 2 and st["dropped_all_equal"] == 4
    assert st["dropped_by_value"] == {"1": 1, "0": 2, "0.5": 1}
    g = DynamicFilter()
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert g.stats() == st


def test_dynamic_filter_on_objects_with_tolerance():
    groups = [{"id": 1, "r": [0.3, 0.3 + 1e-9]}, {"id": 2, "r": [0.0, 1.0]}]
    f = DynamicFilter(lambda g: g["r"], atol=1e-6)
    assert [g["id"] for g in f(groups)] == [2]
    with pytest.raises(ValueError, match="rewards"):
        f([{"r": []}])
