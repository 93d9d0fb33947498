"""Code verifier: runs a completion's program against the record's tests in the sandbox."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

import msgspec

from rlax_data.datasets import CodeTests, Record
from rlax_data.verify.base import VerifyItem, VerifyResult
from rlax_data.verify.sandbox import ExecJob, JobResult, Sandbox, SandboxConfig

__all__ = ["CodeConfig", "CodeVerifier", "extract_code", "jobs_for"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block of `text`, or `text` itself when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


class CodeConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag="code"
):
    """fenced: take the last ``` block of the completion (else the raw completion).
    partial_credit: reward = fraction of cases passed (else 1 only if all pass)."""

    sandbox: SandboxConfig = SandboxConfig()
    fenced: bool = True
    partial_credit: bool = False


def jobs_for(program: str, tests: CodeTests) -> list[ExecJob]:
    """One job for the script + call cases (one process), one per stdin/stdout case."""
    jobs = []
    if tests.script or tests.calls:
        jobs.append(
            ExecJob(
                mode="tests",
                program=program,
                script=tests.script,
                prelude=tests.prefix,
                entry_point=tests.entry_point,
                calls=[msgspec.to_builtins(c) for c in tests.calls],
                timeout_s=tests.timeout_s,
            )
        )
    for case in tests.io:
        jobs.append(
            ExecJob(
                mode="io",
                program=program,
                stdin=case.stdin,
                expected_stdout=case.stdout,
                timeout_s=tests.timeout_s,
            )
        )
    return jobs


class CodeVerifier:
    """Runs all jobs of a batch through one bounded pool, then folds them per item.

    The sandbox is built when first used, not here: a service or a routing verifier that
    holds a code route starts, and serves its other routes, on a host without bubblewrap;
    the code route's items are refused, each with the error that names what to install."""

    def __init__(self, config: CodeConfig | None = None, sandbox: Sandbox | None = None) -> None:
        self.config = config or CodeConfig()
        self._sandbox = sandbox
        self._sandbox_lock = threading.Lock()

    @property
    def sandbox(self) -> Sandbox:
        with self._sandbox_lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(self.config.sandbox)
            return self._sandbox

    def program_for(self, completion: str, record: Record) -> str:
        tests = self._tests(record)
        body = extract_code(completion) if self.config.fenced else completion
        return tests.prefix + body

    @staticmethod
    def _tests(record: Record) -> CodeTests:
        if record.tests is None:
            raise ValueError(f"record {record.id!r}: field `tests` is required by the code verifier")
        return record.tests

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        spans: list[tuple[int, int]] = []
        jobs: list[ExecJob] = []
        for completion, record in items:
            job_list = jobs_for(self.program_for(completion, record), self._tests(record))
            spans.append((len(jobs), len(jobs) + len(job_list)))
            jobs.extend(job_list)
        results = self.sandbox.run(jobs)
        return [self._fold(results[a:b]) for a, b in spans]

    def _fold(self, results: list[JobResult]) -> VerifyResult:
        cases = [c for r in results for c in r.cases]
        passed = sum(c.passed for c in cases)
        ok = bool(cases) and passed == len(cases)
        reward = (passed / len(cases) if cases else 0.0) if self.config.partial_credit else float(ok)
        failures = [{"case": c.case, "error": c.error[:500]} for c in cases if not c.passed][:5]
        details = {
            "passed": passed,
            "total": len(cases),
            "status": [r.status for r in results],
            "failures": failures,
            "isolation": self.sandbox.isolation["mode"],
        }
        return VerifyResult(reward=reward, correct=ok, details=details)
