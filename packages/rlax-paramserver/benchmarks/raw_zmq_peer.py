"""Raw ZeroMQ PUSH/PULL peer used as the bandwidth reference by bench_paramserver.py.

Run as a subprocess: ``python raw_zmq_peer.py STREAMS IO_THREADS FRAME_BYTES...``. It binds
a REP control socket, STREAMS PUSH sockets and one PULL socket on loopback and prints
their ports as one line. Commands on the control socket:

- ``send K OFFSET``: stream every frame (copy=False) over PUSH sockets OFFSET..OFFSET+K-1
  at once (the reference for K concurrent pulls), answer ``done`` when all went out;
- ``recv``: receive every frame on the PULL socket, keeping them all as a server
  keeps a pushed version, answer ``done`` (the reference for a push);
- ``quit``.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import zmq


def main() -> None:
    streams, io_threads = int(sys.argv[1]), int(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3:]]
    # Distinct memory per frame, like a real model (content does not matter to the wire).
    payload = memoryview(np.ones(sum(sizes), dtype=np.uint8))
    offsets = np.cumsum([0, *sizes])
    frames = [payload[offsets[i] : offsets[i] + n] for i, n in enumerate(sizes)]
    context = zmq.Context(io_threads=io_threads)
    control = context.socket(zmq.REP)
    control_port = control.bind_to_random_port("tcp://127.0.0.1")
    pushers = [context.socket(zmq.PUSH) for _ in range(streams)]
    ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in pushers]
    puller = context.socket(zmq.PULL)
    pull_port = puller.bind_to_random_port("tcp://127.0.0.1")
    print(control_port, pull_port, *ports, flush=True)

    def send_all(socket: zmq.Socket) -> None:
        for frame in frames:
            socket.send(frame, copy=False)

    while control.poll(600_000):
        command = control.recv_string()
        if command == "quit":
            control.send_string("bye")
            break
        if command == "recv":
            held = [puller.recv(copy=False) for _ in frames]
            del held
        else:
            _, k, offset = command.split()
            chosen = pushers[int(offset) : int(offset) + int(k)]
            threads = [threading.Thread(target=send_all, args=(socket,)) for socket in chosen]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        control.send_string("done")
    for socket in (*pushers, puller, control):
        socket.close(linger=0)
    context.term()


if __name__ == "__main__":
    main()
