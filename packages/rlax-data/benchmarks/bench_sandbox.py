"""Sandboxed code execution vs the same programs run as bare subprocesses (no isolation).

The ratio is the price of isolation per HumanEval problem, measured side by side: two
bubblewrap jobs per problem (the program's and the check script's, each with its own user,
pid, network and mount namespaces, a private uid, limits and a private tmpfs), the calls of
the entry point relayed between them as plain values, and the verdict taken outside both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from rlax_data.humaneval import humaneval_records
from rlax_data.verify import CodeConfig, CodeVerifier, SandboxConfig

N_PROBLEMS = 48


def _bare(program: str) -> bool:
    out = subprocess.run([sys.executable, "-I", "-S", "-c", program], capture_output=True, timeout=30)
    return out.returncode == 0


def test_sandbox_vs_bare_subprocess(benchmark):
    recs = humaneval_records()[:N_PROBLEMS]
    workers = os.cpu_count() or 1
    verifier = CodeVerifier(CodeConfig(fenced=False, sandbox=SandboxConfig(workers=workers)))
    items = [(r.metadata["canonical_solution"], r) for r in recs]
    verifier.verify(items[:1])  # self-check and warm caches outside the timing
    programs = [r.tests.prefix + r.metadata["canonical_solution"] + "\n" + r.tests.script for r in recs]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        bare_ok = list(pool.map(_bare, programs))
    bare_s = time.perf_counter() - t0

    results = benchmark.pedantic(verifier.verify, args=(items,), rounds=3, iterations=1)
    sandbox_s = benchmark.stats.stats.mean
    assert all(bare_ok) and all(r.correct for r in results)
    print(
        f"\nsandbox {sandbox_s / N_PROBLEMS * 1e3:.1f} ms/problem vs bare subprocess "
        f"{bare_s / N_PROBLEMS * 1e3:.1f} ms/problem -> ratio {sandbox_s / bare_s:.2f}x "
        f"({workers} workers, isolation {verifier.sandbox.isolation['network']})"
    )
