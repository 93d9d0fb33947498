"""Raw ZeroMQ PUSH sender used as the bandwidth reference by bench_paramserver.py.

Run as a subprocess: ``python raw_zmq_peer.py STREAMS IO_THREADS FRAME_BYTES...``. It binds
one REP control socket and STREAMS PUSH sockets on loopback, prints their ports as one
line, then on each ``go K`` request streams every frame (copy=False) over the first K
PUSH sockets at once, and answers ``done`` when all went out. ``quit`` ends it.
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
    print(control_port, *ports, flush=True)

    def send_all(socket: zmq.Socket) -> None:
        for frame in frames:
            socket.send(frame, copy=False)

    while True:
        if not control.poll(600_000):
            break
        command = control.recv_string()
        if command == "quit":
            control.send_string("bye")
            break
        k = int(command.split()[1])
        threads = [threading.Thread(target=send_all, args=(pushers[i],)) for i in range(k)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        control.send_string("done")
    for socket in (*pushers, control):
        socket.close(linger=0)
    context.term()


if __name__ == "__main__":
    main()
