"""Resident memory of a real server process after 10,000 reconnecting clients (issue 12)."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

import rlax_protocol as rp
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server_process
from rlax_protocol.fuzzing import request_id_part
from rlax_protocol.procfs import memory_mb

CLIENTS = 10_000
LIMIT_BYTES = 50 * 1024 * 1024


def resident_bytes(pid: int) -> int:
    """VmRSS of process `pid`."""
    mib = memory_mb(pid, "VmRSS")
    assert mib is not None, f"process {pid} is gone"
    return int(mib * 1024 * 1024)


def one_visit(context: zmq.Context, address: str, n: int, manifest: rp.TensorManifest) -> None:
    """A client that connects, says Hello, long-polls, starts a push and a pull, and vanishes."""
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(address)
    try:
        requests = [
            rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id=f"client-{n}"),
            rp.PullBegin(prefetch_bytes=1024),
            rp.PushBegin(version=10 + n, manifest=manifest, metadata={"n": n}),
            rp.WaitNewer(version=10**9, timeout_ms=60_000),  # parked: never answered before we leave
        ]
        for request_id, message in enumerate(requests):
            socket.send_multipart([request_id_part(request_id), rp.encode(message)])
            if not isinstance(message, rp.WaitNewer):
                assert socket.poll(10_000), f"client {n}: no answer to {type(message).__name__}"
                socket.recv_multipart()
    finally:
        socket.close(0)


@pytest.mark.slow
def test_rss_after_ten_thousand_reconnecting_clients_stays_within_50_mb() -> None:
    tree = {"w": np.ones(1 << 16, np.float32)}
    manifest = rp.encode_tree({"p": np.zeros(4096, np.uint8)}, chunk_bytes=1024).manifest
    # Small chunks: a pull's prefetch takes one frame, so every visit leaves a lease behind.
    with (
        running_server_process() as server,
        ParamClient(server.address, timeout_s=10, chunk_bytes=16 * 1024) as client,
    ):
        client.push(tree, 1)
        start = resident_bytes(server.process.pid)
        context = zmq.Context()
        try:
            for n in range(CLIENTS):
                one_visit(context, server.address, n, manifest)
        finally:
            context.term()
        stats = client.stat()
        end = resident_bytes(server.process.pid)
        print(
            f"\nparamserver RSS: {start / 2**20:.1f} MiB at start, {end / 2**20:.1f} MiB after "
            f"{CLIENTS} reconnecting clients (+{(end - start) / 2**20:.1f} MiB); "
            f"clients={stats.clients} waiters={getattr(stats, 'waiters', '?')} pending_pushes={stats.pending_pushes} "
            f"pulls_in_flight={stats.pulls_in_flight}"
        )
        assert end - start < LIMIT_BYTES
        assert client.pull().version == 1  # type: ignore[union-attr]
