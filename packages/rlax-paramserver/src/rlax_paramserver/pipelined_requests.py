"""Many requests to the parameter server in flight at once (a push's chunks, a pull's
fetches), resent on a fresh connection when a reply is late."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import zmq

from rlax_paramserver.client_errors import typed_error
from rlax_protocol import ProtocolTimeoutError, RemoteError, Reply, RpcClient
from rlax_protocol.messages import ErrorReply, Message

Part = memoryview | zmq.Frame | bytes


def split_into_messages(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Split frames (by size) into consecutive (first, count) runs of at most `budget` bytes (>= 1 frame each)."""
    runs: list[tuple[int, int]] = []
    first, total = 0, 0
    for index, size in enumerate(sizes):
        if index > first and total + size > budget:
            runs.append((first, index - first))
            first, total = index, 0
        total += size
    if sizes:
        runs.append((first, len(sizes) - first))
    return runs


def run_pipelined(
    rpc: RpcClient,
    requests: list[tuple[Message, Sequence[Part]]],
    window: int,
    operation: str,
    on_reply: Callable[[int, Reply], None],
    before_send: Callable[[int], None] | None = None,
) -> None:
    """Send `requests` with up to `window` in flight and hand each reply to `on_reply(index, reply)`
    as it arrives. A timeout resends exactly the requests still unanswered, on a fresh
    connection, with bounded retries and backoff (the server treats repeats as idempotent).
    `before_send(index)` runs before request `index` is first sent: work done there
    overlaps with the requests already on the wire."""
    queue = collections.deque(range(len(requests)))
    in_flight: dict[int, int] = {}  # request id -> index
    attempt = 0
    prepared = 0  # requests 0..prepared-1 went through before_send
    while queue or in_flight:
        try:
            while queue and len(in_flight) < window:
                index = queue[0]
                if before_send is not None and index >= prepared:
                    before_send(index)
                    prepared = index + 1
                message, frames = requests[index]
                in_flight[rpc.send_request(message, frames)] = index
                queue.popleft()
            request_id, reply = rpc.recv_reply(set(in_flight), timeout_s=rpc.timeout_s, operation=operation)
        except ProtocolTimeoutError:
            attempt += 1
            rpc.reset()
            if attempt > rpc.retries:
                raise ProtocolTimeoutError(rpc.peer, operation, rpc.timeout_s, attempts=attempt) from None
            queue.extendleft(sorted(in_flight.values(), reverse=True))
            in_flight.clear()
            time.sleep(rpc.backoff(attempt - 1))
            continue
        index = in_flight.pop(request_id)
        if isinstance(reply.message, ErrorReply):
            # Replies still in flight are dropped later by their request ids.
            raise typed_error(RemoteError(reply.message.code, reply.message.message, peer=rpc.peer))
        on_reply(index, reply)
        attempt = 0
