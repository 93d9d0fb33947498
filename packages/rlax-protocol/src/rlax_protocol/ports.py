"""Choosing a TCP port for a server that starts later (a launcher plans every address first).

A port from ``bind(0)`` lies in the kernel's ephemeral range, the range it also hands out as
the local port of every outgoing connection on the host. Between the choice and the server's
own bind, any client connection may take it, and a connection that lives long (a worker's
link to the parameter server) keeps it: a restarted server then fails to bind the same port
every time (seen: a worker restarted ten times on ``Address already in use``). Ports below the
ephemeral range are never given to outgoing connections, so a port chosen there stays free
unless another server is told to bind it.
"""

from __future__ import annotations

import pathlib
import random
import socket

__all__ = ["ephemeral_range", "reserve_port"]

_RANGE_FILE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below: well-known and registered services, more often taken
_MIN_CHOICES = 1_000  # fewer ports than this below the ephemeral range: use bind(0) instead
_ATTEMPTS = 64
_random = random.SystemRandom()  # not the test's seeded `random`: runs side by side must differ


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' local ports (Linux), or None."""
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # ZeroMQ binds with SO_REUSEADDR: a port held only by connections in TIME_WAIT is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def reserve_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now and that outgoing connections will
    not take: chosen at random below the ephemeral range where there is room, else from
    ``bind(0)``."""
    span = ephemeral_range()
    if span is not None and span[0] - _LOWEST >= _MIN_CHOICES:
        for _ in range(_ATTEMPTS):
            port = _random.randrange(_LOWEST, span[0])
            if _is_free(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
