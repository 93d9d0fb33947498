"""The `rlax-verifier` service on loopback vs the same verifier in-process.

The ratio is the cost of sending verification over ZeroMQ (encode, two socket hops,
batching window) for cheap answers, where it matters most.
"""

from __future__ import annotations

import threading
import time

from rlax_data.service import RemoteVerifier, VerifierService, default_routes
from rlax_data.tasks import ArithmeticTask
from rlax_data.verify import build_verifier

N_ITEMS = 2000


def test_service_vs_in_process(benchmark):
    recs = ArithmeticTask().generate(N_ITEMS, seed=0)
    items = [(r.answer, r) for r in recs]
    local = build_verifier(default_routes())
    t0 = time.perf_counter()
    local_res = local.verify(items)
    local_s = time.perf_counter() - t0

    svc = VerifierService(build_verifier(default_routes()), address="tcp://127.0.0.1:*", poll_s=0.05)
    thread = threading.Thread(target=svc.serve)
    thread.start()
    remote = RemoteVerifier(svc.bound_address, timeout_s=120)
    try:
        remote_res = benchmark.pedantic(remote.verify, args=(items,), rounds=3, iterations=1)
    finally:
        remote.close()
        svc.stop()
        thread.join(timeout=10)
        svc.close()
    remote_s = benchmark.stats.stats.mean
    assert [r.correct for r in remote_res] == [r.correct for r in local_res]
    print(
        f"\nservice {N_ITEMS / remote_s:,.0f} items/s vs in-process {N_ITEMS / local_s:,.0f} items/s "
        f"-> ratio {remote_s / local_s:.1f}x slower over loopback"
    )
