"""Acceptance: HumanEval canonical solutions pass the sandbox; `return None` bodies fail."""

from __future__ import annotations

import pytest

from rlax_data.humaneval import humaneval_records
from rlax_data.verify import CodeConfig, CodeVerifier


@pytest.fixture(scope="module")
def problems():
    recs = humaneval_records()
    assert len(recs) == 164
    return recs


def test_humaneval_canonical_pass_and_stubs_fail(problems, sandbox):
    v = CodeVerifier(CodeConfig(fenced=False), sandbox=sandbox)
    canonical = v.verify([(r.metadata["canonical_solution"], r) for r in problems])
    failed = [r.id for r, res in zip(problems, canonical) if not res.correct]
    assert failed == []
    stubs = v.verify([("    return None\n", r) for r in problems])
    n_failing = sum(not res.correct for res in stubs)
    assert n_failing >= 160, [r.id for r, res in zip(problems, stubs) if res.correct]
    assert all(res.details["status"] for res in stubs)
