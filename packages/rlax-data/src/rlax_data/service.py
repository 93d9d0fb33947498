"""`rlax-verifier`: verification as a ZeroMQ service, so scoring scales out to other hosts.

Wire format: the `rlax_protocol` request/reply framing (DEALER client -> ROUTER server).
A client says `Hello`, then sends `VerifyRequest`s, pipelined; the server drains what
has arrived (up to `max_batch`) and scores it as one batch per verifier route, so the
code sandbox runs the batch's programs in parallel. Each request gets its own
`VerifyResult`, or an `ErrorReply` when it is malformed, names no verifier, or holds a
record its verifier refuses; such a request fails alone (see `VerifierService`). No
message, however hostile, stops the loop: an exception while handling one message is
answered with an ErrorReply (code "internal") where the sender is known, and the
server keeps serving. Every receive has a timeout (the loop wakes at least every
`poll_s` to check for shutdown).

How a `VerifyRequest` maps onto a record: `verifier` picks the route (it becomes the
record's `task`); `extra["record"]`, when present, is a JSON-encoded `Record` (tests
for code, numbers and target for Countdown); otherwise the record is built from
`reference` (the answer) and `extra["metadata"]` (a JSON object), if given.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import yaml
import zmq

import rlax_protocol as rp
from rlax_data.datasets import Record
from rlax_data.verify.answers import ExactMatchConfig, MathConfig
from rlax_data.verify.base import Verifier, VerifyItem, VerifyResult
from rlax_data.verify.code import CodeConfig
from rlax_data.verify.countdown import CountdownConfig
from rlax_data.verify.registry import RoutingConfig, RoutingVerifier, build_verifier, load_verifier_config
from rlax_protocol.transport import unpack_request_id

__all__ = ["RemoteVerifier", "VerifierService", "default_routes", "main"]

log = logging.getLogger("rlax_data.service")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5599"


def default_routes() -> RoutingConfig:
    """Routes served when no config is given: the general verifiers and the built-in tasks."""
    return RoutingConfig(
        routes={
            "math": MathConfig(),
            "exact_match": ExactMatchConfig(),
            "countdown": CountdownConfig(),
            "code": CodeConfig(),
            "arithmetic": ExactMatchConfig(),
            "sorting": ExactMatchConfig(case_sensitive=True),
        }
    )


class _BadRequest(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _describe(error: BaseException) -> str:
    # Bounded: an error message may quote the offending input, which may be huge.
    return f"{type(error).__name__}: {error}"[:500]


def request_to_item(req: rp.VerifyRequest, routes: Sequence[str]) -> VerifyItem:
    """(completion, record) for one request; raises `_BadRequest` naming the bad field."""
    if req.verifier not in routes:
        raise _BadRequest(
            "not_found", f"VerifyRequest.verifier={req.verifier!r}: not one of {sorted(routes)}"
        )
    if "record" in req.extra:
        try:
            record = msgspec.json.decode(req.extra["record"], type=Record)
        except (msgspec.DecodeError, RecursionError) as e:  # ValidationError is a DecodeError
            # msgspec recurses into nested JSON: deep nesting exhausts the stack.
            raise _BadRequest("malformed", f"VerifyRequest.extra['record']: {_describe(e)}") from None
        record = msgspec.structs.replace(record, task=req.verifier)
        if record.tests is not None and (
            record.tests.timeout_s is None or record.tests.timeout_s > req.timeout_s
        ):
            # The client's deadline caps each sandboxed job of this request.
            record = msgspec.structs.replace(
                record, tests=msgspec.structs.replace(record.tests, timeout_s=req.timeout_s)
            )
    else:
        metadata: dict[str, Any] = {}
        if "metadata" in req.extra:
            try:
                metadata = msgspec.json.decode(req.extra["metadata"], type=dict[str, Any])
            except (msgspec.DecodeError, RecursionError) as e:
                raise _BadRequest("malformed", f"VerifyRequest.extra['metadata']: {_describe(e)}") from None
        try:
            record = Record(
                id=req.request_id or "-",
                prompt="",
                answer=req.reference,
                task=req.verifier,
                metadata=metadata,
            )
        except ValueError as e:
            raise _BadRequest("malformed", f"VerifyRequest: {e}") from None
    return req.completion, record


class VerifierService:
    """The ROUTER loop. `serve()` runs until `stop()` (or SIGTERM/SIGINT via `main`).

    A batch is scored one verifier route at a time, so a record one route refuses
    cannot make another route's programs run again. Within a route, a batch that
    raises is split in halves until each refused record stands alone: the refused
    record gets an ErrorReply, and the rest are scored in the largest batches that
    succeed. Verifiers check every record of a batch before they run anything (the
    code verifier builds all its jobs before it starts the sandbox), so a refused
    batch has run no program and no program runs twice.
    """

    def __init__(
        self,
        verifier: RoutingVerifier,
        *,
        address: str = DEFAULT_ADDRESS,
        max_batch: int = 256,
        batch_window_s: float = 0.005,
        poll_s: float = 0.2,
        server_id: str = "rlax-verifier",
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self.verifier = verifier
        self.address = address
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.poll_s = poll_s
        self.server_id = server_id
        self.peers = rp.PeerRegistry()
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(address)
        self.bound_address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self.stats = {"requests": 0, "batches": 0, "errors": 0, "internal_errors": 0}

    def stop(self) -> None:
        self._running = False

    def close(self) -> None:
        self._sock.close(linger=0)

    def _send(self, identity: bytes, request_id: int, msg: rp.Message) -> None:
        try:
            rp.send_within(
                self._sock,
                rp.reply_parts(identity, request_id, msg),
                timeout_s=5.0,
                peer="client",
                operation="reply",
            )
        except rp.ProtocolTimeoutError:
            log.warning("dropped a reply to a client that stopped reading")
        except zmq.ZMQError as e:  # e.g. the peer is gone; the next client must still be served
            log.warning("dropped a reply: %s", e)

    def _error(self, identity: bytes, request_id: int, code: str, message: str) -> None:
        self.stats["errors"] += 1
        self._send(identity, request_id, rp.ErrorReply(code=code, message=message))

    def _collect(self) -> list[list[zmq.Frame]]:
        try:
            batch = [rp.recv_within(self._sock, timeout_s=self.poll_s, peer="clients", operation="request")]
        except rp.ProtocolTimeoutError:
            return []
        end = time.monotonic() + self.batch_window_s
        while len(batch) < self.max_batch:
            try:
                batch.append(
                    rp.recv_within(
                        self._sock,
                        timeout_s=max(0.0, end - time.monotonic()),
                        peer="clients",
                        operation="request",
                    )
                )
            except (rp.ProtocolTimeoutError, zmq.ZMQError):
                break  # score what arrived; a socket error recurs at the next first receive
        return batch

    def _internal(self, identity: bytes, request_id: int, error: BaseException) -> None:
        """Answer a message whose handling raised unexpectedly; the loop goes on."""
        self.stats["internal_errors"] += 1
        log.error("request failed unexpectedly: %s", _describe(error), exc_info=error)
        if identity:
            self._error(identity, request_id, "internal", _describe(error))

    def _admit(self, parts: list[zmq.Frame]) -> _Pending | None:
        """Parse one message and answer it at once unless it is a VerifyRequest to score."""
        req = rp.parse_request(parts)
        if req.error is not None or req.message is None:
            self._error(
                req.identity, req.request_id, "malformed", _describe(req.error or ValueError("empty"))
            )
            return None
        msg = req.message
        if isinstance(msg, rp.Hello):
            welcome = rp.welcome_for(msg, server_id=self.server_id)
            if welcome.accepted:
                self.peers.admit(req.identity)
            self._send(req.identity, req.request_id, welcome)
        elif not self.peers.touch(req.identity):
            self._error(req.identity, req.request_id, "handshake_required", "say Hello first")
        elif isinstance(msg, rp.VerifyRequest):
            try:
                item = request_to_item(msg, list(self.verifier.routes))
            except _BadRequest as e:
                self._error(req.identity, req.request_id, e.code, str(e))
                return None
            return _Pending(req.identity, req.request_id, msg, item)
        else:
            self._error(
                req.identity, req.request_id, "unknown_message", f"{type(msg).__name__} is not served here"
            )
        return None

    def serve_once(self) -> int:
        """Receive (with a timeout) and answer one batch; returns how many requests it held."""
        raw = self._collect()
        todo: list[_Pending] = []
        for parts in raw:
            self.stats["requests"] += 1
            try:
                pending = self._admit(parts)
            except Exception as e:  # one message must never stop the loop
                self._internal(_identity_of(parts), _request_id_of(parts), e)
                continue
            if pending is not None:
                todo.append(pending)
        if todo:
            self.stats["batches"] += 1
            results: list[VerifyResult | Exception]
            try:
                results = self._verify([p.item for p in todo])
            except Exception as e:  # not one item's fault (`_verify` catches those): answer all
                results = [e] * len(todo)
                log.error("scoring a batch failed: %s", _describe(e), exc_info=e)
            for p, res in zip(todo, results, strict=True):
                try:
                    self._answer(p, res)
                except Exception as e:
                    self._internal(p.identity, p.request_id, e)
        return len(raw)

    def _answer(self, p: _Pending, res: VerifyResult | Exception) -> None:
        if isinstance(res, Exception):
            self._error(p.identity, p.request_id, "bad_request", _describe(res))
            return
        detail = msgspec.json.encode(res.details).decode()
        reply = rp.VerifyResult(
            request_id=p.message.request_id, reward=res.reward, correct=res.correct, detail=detail
        )
        self._send(p.identity, p.request_id, reply)

    def _verify(self, items: list[VerifyItem]) -> list[VerifyResult | Exception]:
        """One result or the exception that refused it, per item, route by route."""
        out: list[VerifyResult | Exception | None] = [None] * len(items)
        by_route: dict[str, list[int]] = {}
        for i, (_, record) in enumerate(items):
            by_route.setdefault(record.task or "", []).append(i)  # `request_to_item` set a served route
        for route, indices in by_route.items():
            self._verify_route(self.verifier.routes[route], items, indices, out)
        return out  # type: ignore[return-value]

    def _verify_route(
        self,
        verifier: Verifier,
        items: list[VerifyItem],
        indices: list[int],
        out: list[VerifyResult | Exception | None],
    ) -> None:
        try:
            results = verifier.verify([items[i] for i in indices])
            if len(results) != len(indices):
                raise RuntimeError(f"verifier returned {len(results)} results for {len(indices)} items")
        except Exception as e:
            if len(indices) == 1:
                log.warning("verification failed: %s", _describe(e))
                out[indices[0]] = e
                return
            # Halve until the refused records stand alone; the others keep being scored
            # together (in parallel, for code) in the largest batches that succeed.
            mid = len(indices) // 2
            self._verify_route(verifier, items, indices[:mid], out)
            self._verify_route(verifier, items, indices[mid:], out)
            return
        for i, res in zip(indices, results):
            out[i] = res

    def serve(self) -> None:
        while self._running:
            try:
                self.serve_once()
            except zmq.ContextTerminated:
                return
            except Exception as e:  # outside any one message (the socket itself): log, go on
                self.stats["internal_errors"] += 1
                log.error("serve loop: %s", _describe(e), exc_info=e)
                time.sleep(min(self.poll_s, 0.1))  # no hot loop if the error persists


class _Pending(NamedTuple):
    """A VerifyRequest that passed every check and waits for its batch to be scored."""

    identity: bytes
    request_id: int
    message: rp.VerifyRequest
    item: VerifyItem


def _identity_of(parts: Sequence[zmq.Frame]) -> bytes:
    try:
        return bytes(parts[0].bytes) if parts else b""
    except Exception:
        return b""


def _request_id_of(parts: Sequence[zmq.Frame]) -> int:
    try:
        return unpack_request_id(parts[1]) if len(parts) > 1 else 0
    except Exception:
        return 0


class RemoteVerifier:
    """A `Verifier` whose work is done by an `rlax-verifier` service.

    Requests are pipelined; `timeout_s` bounds the wait for the whole batch (each
    request still has its own receive deadline). Raises `RemoteError` if the service
    refuses an item.
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, *, timeout_s: float = 60.0, client: rp.RpcClient | None = None
    ):
        self.client = client or rp.RpcClient(address, timeout_s=timeout_s, role="verifier-client")
        self.timeout_s = timeout_s

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        ids: dict[int, int] = {}
        for i, (completion, record) in enumerate(items):
            req = rp.VerifyRequest(
                request_id=record.id,
                verifier=record.task or "",
                completion=completion,
                reference=record.answer or "",
                extra={"record": msgspec.json.encode(record).decode()},
            )
            ids[self.client.send_request(req)] = i
        out: list[VerifyResult | None] = [None] * len(items)
        deadline = rp.Deadline(self.timeout_s)
        pending = set(ids)
        while pending:
            rid, reply = self.client.recv_reply(
                pending, timeout_s=deadline.remaining(), operation="VerifyRequest"
            )
            pending.discard(rid)
            msg = reply.message
            if isinstance(msg, rp.ErrorReply):
                raise rp.RemoteError(msg.code, msg.message, peer=self.client.peer)
            if not isinstance(msg, rp.VerifyResult):
                raise rp.MalformedMessageError(f"verifier answered with {type(msg).__name__}")
            details = msgspec.json.decode(msg.detail) if msg.detail else {}
            out[ids[rid]] = VerifyResult(reward=msg.reward, correct=msg.correct, details=details)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.client.close()


def _load_config(path: str | None) -> RoutingConfig:
    if path is None:
        return default_routes()
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (a verifier config), got {type(data).__name__}")
    cfg = load_verifier_config(data)
    if not isinstance(cfg, RoutingConfig):
        raise ValueError(f"{path}: field `kind` must be 'routing' for the service, got {data.get('kind')!r}")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlax-verifier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default=DEFAULT_ADDRESS, help="ZeroMQ address to bind (default: loopback)")
    parser.add_argument("--config", help="YAML routing config ({kind: routing, routes: {...}})")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--poll-s", type=float, default=0.2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlax-verifier %(levelname)s %(message)s")
    cfg = _load_config(args.config)
    verifier = build_verifier(cfg)
    assert isinstance(verifier, RoutingVerifier)
    service = VerifierService(verifier, address=args.bind, max_batch=args.max_batch, poll_s=args.poll_s)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    # The bound address (a random port when asked for :0) is the first line on stdout.
    print(service.bound_address, flush=True)
    log.info("serving routes %s", sorted(verifier.routes))
    try:
        service.serve()
    finally:
        service.close()
    log.info("stopped after %s", service.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
