"""Peers on loopback for the controller parts' tests: a worker's side of the controller's
request link (a real ROUTER socket the test thread answers by hand), and a polling wait."""

from __future__ import annotations

import socket
import time
from typing import Any

import zmq

from rlax_protocol.messages import GenerateRequest, GenerateResult, Hello, Message, Sample
from rlax_protocol.transport import Request, pack_request_id, parse_request, reply_parts, welcome_for


class WorkerSocket:
    """Answers Hello with a Welcome from `server_id`; keeps every other request for the test."""

    def __init__(self, address: str, server_id: str = "life1") -> None:
        self.address = address
        self.server_id = server_id
        self.requests: list[Request] = []
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.bind(address)

    def serve(self) -> None:
        """Takes whatever has arrived (non-blocking)."""
        while self.socket.poll(0):
            request = parse_request(self.socket.recv_multipart(copy=False))
            if isinstance(request.message, Hello):
                self.answer(request, welcome_for(request.message, server_id=self.server_id))
            else:
                self.requests.append(request)

    def answer(self, request: Request, message: Message) -> None:
        self.socket.send_multipart(reply_parts(request.identity, request.request_id, message))

    def send_raw(self, request: Request, *parts: bytes) -> None:
        self.socket.send_multipart([request.identity, pack_request_id(request.request_id), *parts])

    def take_generate(self, pump: Any, timeout_s: float = 10.0) -> tuple[Request, GenerateRequest]:
        """The next GenerateRequest, calling `pump()` (the controller side) meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.serve()
            for request in self.requests:
                if isinstance(request.message, GenerateRequest):
                    self.requests.remove(request)
                    return request, request.message
            assert time.monotonic() < deadline, "no GenerateRequest arrived"
            pump()
            time.sleep(0.005)

    def close(self) -> None:
        """Close the socket and return once nothing listens on its port any more: ZeroMQ
        closes a listener in its I/O thread, after `close` returns, and a peer connecting
        in between is still accepted (seen under load: a 'dead' worker took a send)."""
        self.socket.close(linger=0)
        host, port = self.address.removeprefix("tcp://").rsplit(":", 1)
        wait_until(lambda: not _listening(host, int(port)), lambda: None, timeout_s=10.0)


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def result_for(
    request: GenerateRequest, *, version: int = 0, request_id: str | None = None
) -> GenerateResult:
    """A well-formed result: `request.n` two-token samples at `version`."""
    samples = tuple(
        Sample(token_ids=(3 + i % 4, 4), logprobs=(-0.5, -0.25), finish_reason="stop")
        for i in range(request.n)
    )
    return GenerateResult(
        request_id=request_id or request.request_id, samples=samples, weight_version=version
    )


def wait_until(condition: Any, pump: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        pump()
        time.sleep(0.005)
