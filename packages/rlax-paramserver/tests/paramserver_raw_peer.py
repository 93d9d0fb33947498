"""A bare DEALER socket for tests that must send what a `ParamClient` never would."""

from __future__ import annotations

import zmq

import rlax_protocol as rp
from rlax_protocol.transport import pack_request_id, unpack_request_id


class RawPeer:
    """A bare DEALER socket that can send anything at all."""

    def __init__(self, address: str, *, hello: bool = True) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(address)
        self.next_id = 1
        if hello:
            assert isinstance(
                self.request([rp.encode(rp.Hello(protocol_version=rp.PROTOCOL_VERSION))]), rp.Welcome
            )

    def send(self, parts: list[bytes]) -> None:
        self.socket.send_multipart(parts)

    def reply(self, timeout_ms: int = 5000) -> tuple[int, rp.Message, list[bytes]]:
        assert self.socket.poll(timeout_ms), "the server did not answer"
        parts = self.socket.recv_multipart()
        return unpack_request_id(parts[0]), rp.decode(parts[1]), parts[2:]

    def request(self, parts: list[bytes], frames: list[bytes] = ()) -> rp.Message:
        request_id = self.next_id
        self.next_id += 1
        self.send([pack_request_id(request_id), *parts, *frames])
        got_id, message, _ = self.reply()
        assert got_id == request_id
        return message

    def close(self) -> None:
        self.socket.close(0)
