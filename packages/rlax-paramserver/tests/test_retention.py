"""Keep-N retention with pull leases, including leases of clients that die."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np

from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol import PullBegin, PullEnd, PullGranted, RpcClient


def tiny(version: int) -> dict:
    return {"w": np.full(16, version, np.float32)}


def test_keep_three_after_ten_pushes_and_a_leased_version_survives() -> None:
    with running_server(keep=3) as address, ParamClient(address, timeout_s=5) as client:
        for version in range(1, 11):
            client.push(tiny(version), version)
        assert client.stat().versions == (8, 9, 10)

        with RpcClient(address, timeout_s=5) as holder:
            lease = holder.call(PullBegin(version=8), expect=PullGranted).message
            for version in range(11, 16):
                client.push(tiny(version), version)
            stats = client.stat()
            assert stats.versions == (8, 13, 14, 15)
            assert stats.pulls_in_flight == 1 and stats.leases_by_version == {8: 1}
            pulled = client.pull(8)  # still servable while pinned
            assert pulled is not None and np.all(pulled.tree["w"] == 8)
            # A completed pull leaves no lease behind; only the holder's remains.
            assert client.stat().leases_by_version == {8: 1}
            holder.call(PullEnd(lease.lease_id))
        assert client.stat().versions == (13, 14, 15)


def test_lease_of_a_killed_client_expires() -> None:
    with running_server(keep=1, lease_ttl_s=0.5) as address, ParamClient(address, timeout_s=5) as client:
        client.push(tiny(1), 1)
        script = textwrap.dedent(
            f"""
            import sys, time
            from rlax_protocol import PullBegin, PullGranted, RpcClient
            rpc = RpcClient({address!r}, timeout_s=5)
            rpc.call(PullBegin(version=1), expect=PullGranted)
            print("leased", flush=True)
            time.sleep(60)
            """
        )
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "leased"
            client.push(tiny(2), 2)
            assert client.stat().versions == (1, 2)
            child.kill()  # dies mid-pull, never sends PullEnd
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        deadline = time.monotonic() + 120  # bounds a hang only
        while client.stat().versions != (2,):
            assert time.monotonic() < deadline, "the dead client's lease never expired"
            time.sleep(0.1)
