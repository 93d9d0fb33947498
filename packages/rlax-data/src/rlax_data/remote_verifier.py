"""`RemoteVerifier`: the client of the verifier service (`rlax-verifier`), a `Verifier`
whose items are scored by the service (see `rlax_data.verifier_wire` for the messages)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

import rlax_protocol as rp
from rlax_data.verifier_wire import (
    DEFAULT_ADDRESS,
    MAX_BATCH_BYTES,
    RETRY_AFTER_S,
    decode_outcome,
    describe,
    encode_batch,
)
from rlax_data.verify.base import VerifyItem, VerifyResult


class RemoteVerifier:
    """A `Verifier` whose work is done by an `rlax-verifier` service.

    The items go in batch messages of at most `chunk_items` items (and about
    `chunk_bytes` bytes), pipelined; `timeout_s` bounds the wait for the whole call. A
    message the service answers ``busy`` (too many of ours waiting) is sent again after
    the wait it suggests, within that bound. Raises `RemoteError` if the service refuses
    an item (naming the first refused).
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float = 60.0,
        client: rp.RpcClient | None = None,
        chunk_items: int = 1024,
        chunk_bytes: int = MAX_BATCH_BYTES // 4,
        sandbox_timeout_s: float = 10.0,
    ):
        if chunk_items < 1 or chunk_bytes < 1:
            raise ValueError(f"chunk_items={chunk_items} and chunk_bytes={chunk_bytes}: must be >= 1")
        self.client = client or rp.RpcClient(address, timeout_s=timeout_s, role="verifier-client")
        self.timeout_s = timeout_s
        self.chunk_items = chunk_items
        self.chunk_bytes = chunk_bytes
        self.sandbox_timeout_s = sandbox_timeout_s

    def _chunks(self, items: Sequence[VerifyItem], start: int) -> list[tuple[int, int, bytes]]:
        """(first index, count, frame) per batch message, halving any over `chunk_bytes`."""
        frame = encode_batch(items)
        if len(frame) <= self.chunk_bytes or len(items) == 1:
            return [(start, len(items), frame)]
        mid = len(items) // 2
        return self._chunks(items[:mid], start) + self._chunks(items[mid:], start + mid)

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        deadline = rp.Deadline(self.timeout_s)
        for attempt in range(2):
            try:
                return self._verify_once(items, deadline)
            except rp.RemoteError as e:
                if e.code != "handshake_required" or attempt:
                    raise
                self.client.reset()  # the service restarted or forgot us: say Hello again
        raise AssertionError("unreachable")

    def _verify_once(self, items: Sequence[VerifyItem], deadline: rp.Deadline) -> list[VerifyResult]:
        sent: dict[int, tuple[int, int, bytes]] = {}

        def send(start: int, count: int, frame: bytes) -> None:
            header = rp.VerifyBatch(
                request_id=f"batch-{start}", items=count, timeout_s=self.sandbox_timeout_s
            )
            rid = self.client.send_request(header, [frame], timeout_s=max(deadline.remaining(), 1e-3))
            sent[rid] = (start, count, frame)
            pending.add(rid)

        pending: set[int] = set()
        for s in range(0, len(items), self.chunk_items):
            for start, count, frame in self._chunks(items[s : s + self.chunk_items], s):
                send(start, count, frame)
        out: list[VerifyResult | None] = [None] * len(items)
        while pending:
            rid, reply = self.client.recv_reply(
                pending, timeout_s=deadline.remaining(), operation="VerifyRequest batch"
            )
            pending.discard(rid)
            start, count, frame = sent.pop(rid)
            msg = reply.message
            if isinstance(msg, rp.ErrorReply) and msg.code == "busy" and deadline.remaining() > RETRY_AFTER_S:
                time.sleep(RETRY_AFTER_S)  # replies meanwhile wait in the socket
                send(start, count, frame)
                continue
            if isinstance(msg, rp.ErrorReply):
                raise rp.RemoteError(msg.code, msg.message, peer=self.client.peer)
            if not isinstance(msg, rp.VerifyBatchResult) or len(reply.frames) != 1:
                raise rp.MalformedMessageError(
                    f"verifier answered a batch with {type(msg).__name__} and {len(reply.frames)} frames"
                )
            try:
                outcome = decode_outcome(reply.frames[0].buffer)
            except (msgspec.DecodeError, RecursionError) as e:
                raise rp.MalformedMessageError(f"verifier's batch reply: {describe(e)}") from None
            if len(outcome.results) != count:
                raise rp.MalformedMessageError(
                    f"verifier answered {len(outcome.results)} of a batch of {count}"
                )
            if outcome.refused:
                n, code, why = outcome.refused[0]
                raise rp.RemoteError(code, f"item {start + n}: {why}", peer=self.client.peer)
            if any(r is None for r in outcome.results):
                raise rp.MalformedMessageError("verifier left an item of a batch without a result")
            out[start : start + count] = outcome.results
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.client.close()
