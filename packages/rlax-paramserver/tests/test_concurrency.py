"""Many clients pulling while versions commit: every pull is one consistent version."""

from __future__ import annotations

import threading
import time

from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server


def test_eight_pullers_while_twenty_versions_commit(stamp) -> None:
    make, check = stamp
    versions = 20
    errors: list[BaseException] = []
    seen: list[list[int]] = [[] for _ in range(8)]
    done = threading.Event()

    with running_server(keep=3, workers=4) as address:
        with ParamClient(address, timeout_s=10) as pusher:
            pusher.push(make(1, layers=4, hidden=64), 1, {"version": 1})

            def pull_loop(index: int) -> None:
                # Small frames and messages so that each pull spans many exchanges.
                client = ParamClient(address, timeout_s=10, chunk_bytes=4096, message_bytes=16384, window=2)
                try:
                    while True:
                        last = done.is_set()
                        pulled = client.pull()
                        assert pulled is not None
                        check(pulled.tree, pulled.version)
                        assert pulled.metadata == {"version": pulled.version}
                        seen[index].append(pulled.version)
                        if last:
                            break
                except BaseException as err:
                    errors.append(err)
                finally:
                    client.close()

            threads = [threading.Thread(target=pull_loop, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for version in range(2, versions + 1):
                pusher.push(make(version, layers=4, hidden=64), version, {"version": version})
                time.sleep(0.02)  # let pulls overlap several commits
            done.set()
            for thread in threads:
                thread.join(120)
            assert not any(t.is_alive() for t in threads), "a puller hung"
            stats = pusher.stat()
    assert not errors, errors
    for history in seen:
        assert history and history == sorted(history)  # a pull never goes back in time
        assert history[-1] == versions
    assert len(stats.versions) == 3 and stats.pulls_in_flight == 0
