"""The parameter server's broker: it forwards client requests to idle worker threads only
and their replies back to the clients (load balancing, so a worker busy verifying a large
commit never delays a pull queued behind it).

Workers talk to the broker over an inproc ROUTER with a one-frame kind first:
``WORKER_READY`` (idle, nothing to send), ``WORKER_REPLY`` (a reply; idle again) or
``WORKER_SEND`` (an extra message, e.g. waking a long-poll; not idle because of it).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import zmq

from rlax_paramserver.long_polls import Wakeup
from rlax_protocol import LatestVersion, encode
from rlax_protocol.auth import ServerAuth
from rlax_protocol.transport import pack_request_id

log = logging.getLogger(__name__)

WORKER_READY, WORKER_REPLY, WORKER_SEND = b"R", b"P", b"S"
POLL_MS = 50
"""How long a thread of the server sleeps at most before it checks whether to stop."""


def forward_until_stopped(frontend: zmq.Socket[Any], backend: zmq.Socket[Any], stop: threading.Event) -> None:
    """Forward between the clients' `frontend` and the workers' `backend` until `stop` is set."""
    idle: collections.deque[bytes] = collections.deque()
    poller = zmq.Poller()
    poller.register(backend, zmq.POLLIN)
    poller.register(frontend, 0)
    while not stop.is_set():
        events = dict(poller.poll(POLL_MS))
        if backend in events:
            while True:
                try:
                    parts = backend.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                worker, kind = parts[0].bytes, parts[1].bytes
                if kind in (WORKER_REPLY, WORKER_SEND) and len(parts) > 2:
                    try:
                        frontend.send_multipart(parts[2:], copy=False)
                    except zmq.ZMQError as err:  # one undeliverable reply must not stop the broker
                        log.error("could not forward a reply: %s", err)
                if kind in (WORKER_READY, WORKER_REPLY):
                    idle.append(worker)
        if frontend in events:
            while idle:
                try:
                    parts = frontend.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                # The connection's authenticated role goes along (a forwarded frame loses it).
                role = ServerAuth.role_of(parts[1]).encode() if len(parts) > 1 else b""
                backend.send_multipart([idle.popleft(), role, *parts], copy=False)
        poller.modify(frontend, zmq.POLLIN if idle else 0)


def send_wakeups(socket: zmq.Socket[Any], wakeups: list[Wakeup]) -> None:
    """Answer the long-polls in `wakeups` (through the broker, from a worker's or the persister's socket)."""
    for w in wakeups:
        socket.send_multipart(
            [WORKER_SEND, w.identity, pack_request_id(w.request_id), encode(LatestVersion(version=w.latest))]
        )
