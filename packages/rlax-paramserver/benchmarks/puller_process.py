"""A puller in its own process, driven by bench_paramserver.py over stdin/stdout.

``python puller_process.py ours ADDRESS`` pulls the latest version from a parameter
server; ``python puller_process.py raw PORT FRAMES`` receives FRAMES raw ZeroMQ frames on
a PULL socket (keeping them, as a pull does). It prints ``ready``, then answers every
``go`` line with ``done`` once its transfer finished; ``quit`` ends it.
"""

from __future__ import annotations

import sys

import zmq


def main() -> None:
    mode = sys.argv[1]
    if mode == "ours":
        from rlax_paramserver import ParamClient

        client = ParamClient(sys.argv[2], timeout_s=60)

        def transfer() -> None:
            assert client.pull() is not None

    else:
        socket = zmq.Context.instance().socket(zmq.PULL)
        socket.connect(f"tcp://127.0.0.1:{sys.argv[2]}")
        count = int(sys.argv[3])

        def transfer() -> None:
            held = []
            for _ in range(count):
                if not socket.poll(120_000):
                    raise TimeoutError("raw PULL: no frame within 120 s")
                held.append(socket.recv(copy=False))

    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        transfer()
        print("done", flush=True)


if __name__ == "__main__":
    main()
