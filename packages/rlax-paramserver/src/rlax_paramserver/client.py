"""Client of the parameter server: push, pull, latest, wait_for_newer, stat.

Every network call has a deadline; calls that are safe to repeat are retried with
exponential backoff on a fresh connection, a bounded number of times. A push streams
the tree as checksummed frames with several messages in flight and is committed
atomically; a pull leases one version, fetches its frames with several requests in
flight and verifies every tensor's checksum before returning it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from rlax_paramserver.client_errors import (
    LeaseExpiredError,
    StaleVersionError,
    VersionNotFoundError,
    typed_error,
)
from rlax_paramserver.local_pull import map_granted_version
from rlax_paramserver.persist import write_staged
from rlax_paramserver.pipelined_requests import Part, run_pipelined, split_into_messages
from rlax_protocol import (
    DEFAULT_CHUNK_BYTES,
    Ack,
    Committed,
    CurveClientConfig,
    Deadline,
    EncodedTree,
    FetchChunks,
    LatestQuery,
    LatestVersion,
    MalformedMessageError,
    NotNewer,
    ProtocolTimeoutError,
    PullBegin,
    PullEnd,
    PullGranted,
    PushAbort,
    PushBegin,
    PushChunks,
    PushCommit,
    PushReady,
    RemoteError,
    Reply,
    RpcClient,
    ServerStats,
    StatQuery,
    TensorManifest,
    TreeAssembler,
    WaitNewer,
    checksum_frames,
    encode_tree,
    frame_layout,
    frames_by_tensor,
    unflatten_tree,
    with_checksums,
)
from rlax_protocol.messages import Chunks, Message

__all__ = [
    "LeaseExpiredError",
    "ParamClient",
    "PulledWeights",
    "StaleVersionError",
    "VersionNotFoundError",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PulledWeights:
    """One consistent version: `tree` is a nested dict of read-only numpy arrays.

    `mapped`: the arrays are views of the server's state file, mapped on this host (no
    bytes were sent); otherwise they hold the received frames."""

    tree: dict[str, Any]
    version: int
    metadata: dict[str, Any]
    mapped: bool = False


class ParamClient:
    """Talks to one parameter server at `address` (``tcp://host:port``).

    timeout_s: deadline of each request/reply exchange (one message of frames, not a
    whole model). retries/backoff_s: how often and how patiently a timed-out exchange is
    repeated. chunk_bytes: frame size a push splits tensors into. message_bytes: frames
    per message, by total size. window: messages in flight per push or pull.
    commit_timeout_s: deadline for a commit (verifies and persists the whole version).
    local: when the server persists its versions and its files are readable here (the
    same host), map a pulled version's file instead of receiving it: no copy of the
    weights in this process, the pages shared with every process mapping the same file.
    The file must hold exactly the granted manifest (checksums included) and, with
    `verify`, its tensors must hash to it; otherwise the frames are fetched as usual.
    A push likewise writes the version into a staging file the server names (the
    server verifies it on commit); where that file cannot be opened it sends frames.
    Otherwise, once a server has given its limits (a first push), a version that fits one
    message (`message_bytes`) goes in one exchange with its commit (`PushBegin.whole`): a
    small model's push costs one round trip, not three.
    resolve: the server's address now (the run's address book), asked before each
    (re)connect and once a second while a reply is awaited, so a parameter server that
    moved to another node is found there (`RpcClient`).
    Calls from several threads are serialised.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        message_bytes: int = 8 * 1024 * 1024,
        window: int = 16,
        commit_timeout_s: float = 300.0,
        verify: bool = True,
        local: bool = True,
        curve: CurveClientConfig | None = None,
        client_id: str = "",
        context: zmq.Context[Any] | None = None,
        resolve: Callable[[], str] | None = None,
    ) -> None:
        for name, value in (
            ("chunk_bytes", chunk_bytes),
            ("message_bytes", message_bytes),
            ("window", window),
        ):
            if value <= 0:
                raise ValueError(f"ParamClient {name}={value}: must be > 0")
        self.chunk_bytes = chunk_bytes
        self.message_bytes = message_bytes
        self.window = window
        self.commit_timeout_s = commit_timeout_s
        self.verify = verify
        self.local = local
        self._rpc = RpcClient(
            address,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            client_id=client_id,
            role="paramclient",
            curve=curve,
            context=context,
            resolve=resolve,
        )
        self._lock = threading.RLock()
        # (address, max_frame_bytes, max_message_bytes) of the server, from its last
        # `PushReady`: a push sends a whole version in one message only within them.
        self._push_limits: tuple[str, int, int] | None = None
        # Whether this client's pushes go through the server's staging files (`local`, and
        # the server named one that could be written): they then never use `whole`.
        self._pushes_by_file = False

    @property
    def address(self) -> str:
        """The server's address as of the last (re)connect."""
        return self._rpc.address

    @property
    def timeout_s(self) -> float:
        return self._rpc.timeout_s

    def close(self) -> None:
        with self._lock:
            self._rpc.close()

    def __enter__(self) -> ParamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, message: Message, frames: Sequence[Part] = (), **kwargs: Any) -> Reply:
        try:
            return self._rpc.call(message, frames, **kwargs)
        except RemoteError as err:
            raise typed_error(err) from None

    def _pipeline(
        self,
        requests: list[tuple[Message, Sequence[Part]]],
        operation: str,
        on_reply: Callable[[int, Reply], None],
        before_send: Callable[[int], None] | None = None,
    ) -> None:
        """`requests` with up to `window` in flight, each reply to `on_reply(index, reply)`
        (`pipelined_requests.run_pipelined`)."""
        run_pipelined(self._rpc, requests, self.window, operation, on_reply, before_send)

    # ------------------------------------------------------------------ push

    def push(
        self, tree: Mapping[str, Any], version: int, metadata: Mapping[str, Any] | None = None
    ) -> Committed:
        """Push `tree` (nested dict of numpy arrays) as `version`; visible atomically on success.

        Raises `StaleVersionError` if `version` is not newer than the server's latest,
        `RemoteError('checksum')` if a frame arrived corrupt, `RemoteError('persist_failed')`
        if the server (with a state dir) could not write it (it is then not visible),
        `ProtocolTimeoutError`.
        """
        encoded = encode_tree(tree, chunk_bytes=self.chunk_bytes, checksums=False)
        with self._lock:
            whole = self._fits_one_message(encoded.frames)
            follow = not whole and self._pushes_over_socket()
            if not follow:
                encoded = with_checksums(encoded)
            begin = PushBegin(
                version=version,
                manifest=encoded.manifest,
                metadata=dict(metadata or {}),
                local=self.local and not follow,
                checksums_follow=follow,
            )
            if whole:
                committed = self._push_whole(begin, encoded.frames)
                if committed is not None:
                    return committed
            ready = self._call(begin, expect=PushReady).message
            assert isinstance(ready, PushReady)
            if ready.max_frame_bytes > 0:
                self._push_limits = (self.address, ready.max_frame_bytes, ready.max_message_bytes)
            self._pushes_by_file = bool(ready.staging_file)
            if ready.staging_file:
                committed = self._push_by_file(ready, encoded.manifest, encoded.frames, version)
                if committed is not None:
                    return committed
                self._pushes_by_file = False
                begin = msgspec.structs.replace(begin, local=False)
                ready = self._call(begin, expect=PushReady).message
                assert isinstance(ready, PushReady)
            try:
                checksums = self._send_frames(ready, encoded, hash_as_sent=follow)
                return self._commit(ready.push_id, version, checksums)
            except BaseException:
                self._abort_quietly(ready.push_id)
                raise

    def _pushes_over_socket(self) -> bool:
        """Whether this client's pushes to the server at the current address send frames:
        it is not `local`, or the server named no staging file for its last push there.
        Those pushes hash each tensor while the ones before it are on the wire."""
        learned = self._push_limits is not None and self._push_limits[0] == self.address
        return not self.local or (learned and not self._pushes_by_file)

    def _send_frames(self, ready: PushReady, encoded: EncodedTree, *, hash_as_sent: bool) -> tuple[int, ...]:
        """Send every frame of `encoded` in `PushChunks` messages, several in flight. With
        `hash_as_sent` each tensor is hashed just before the message that completes it is
        sent (its checksums are returned, in manifest order, for the commit); else ()."""
        budget = min(self.message_bytes, ready.max_message_bytes)
        runs = split_into_messages([f.nbytes for f in encoded.frames], budget)
        requests: list[tuple[Message, Sequence[Part]]] = [
            (PushChunks(ready.push_id, first, count), encoded.frames[first : first + count])
            for first, count in runs
        ]

        def acked(index: int, reply: Reply) -> None:
            if not isinstance(reply.message, Ack):
                raise MalformedMessageError(f"server answered PushChunks with {type(reply.message).__name__}")

        if not hash_as_sent:
            self._pipeline(requests, "PushChunks", acked)
            return ()
        grouped = frames_by_tensor(encoded.manifest, encoded.frames)
        checksums = [0] * len(grouped)
        # The tensors whose last frame goes in message i: hashed before it is sent.
        completed_by: list[list[int]] = [[] for _ in runs]
        last_frame = itertools.accumulate(len(frames) for frames in grouped)
        message_of_frame = [i for i, (_, count) in enumerate(runs) for _ in range(count)]
        for tensor, end in enumerate(last_frame):
            completed_by[message_of_frame[end - 1]].append(tensor)

        def hash_completed(index: int) -> None:
            for tensor in completed_by[index]:
                checksums[tensor] = checksum_frames(grouped[tensor])

        self._pipeline(requests, "PushChunks", acked, hash_completed)
        return tuple(checksums)

    def _fits_one_message(self, frames: Sequence[memoryview]) -> bool:
        """Whether `frames` fit one message within this client's `message_bytes` and the
        limits the server at the current address gave (unknown before a first push there)."""
        if self._pushes_by_file or self._push_limits is None or self._push_limits[0] != self.address:
            return False
        _, max_frame_bytes, max_message_bytes = self._push_limits
        total = sum(f.nbytes for f in frames)
        return total <= min(self.message_bytes, max_message_bytes) and all(
            f.nbytes <= max_frame_bytes for f in frames
        )

    def _push_whole(self, begin: PushBegin, frames: Sequence[memoryview]) -> Committed | None:
        """A version that fits one message, pushed and committed in one exchange
        (`PushBegin.whole`); None when the server has no room for it in one message."""
        try:
            return self._await_commit(
                msgspec.structs.replace(begin, whole=True, local=False), frames, begin.version
            )
        except RemoteError as err:
            if err.code != "too_large":
                raise
            self._push_limits = None  # the server's limits changed: the next PushReady says
            log.info("pushing version %d in parts: %s", begin.version, err.remote_message)
            return None
        except ProtocolTimeoutError:
            # A server restarted with a smaller frame limit drops such a message unanswered:
            # the next push goes in parts and learns the limits again.
            self._push_limits = None
            raise

    def _push_by_file(
        self, ready: PushReady, manifest: TensorManifest, frames: Sequence[memoryview], version: int
    ) -> Committed | None:
        """Write the version into the server's staging file and commit it; None (the push
        aborted) when this host cannot open that file, so the caller sends the frames."""
        try:
            write_staged(ready.staging_file, ready.data_offset, manifest, frames)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as err:
            log.info(
                "pushing version %d over the network: cannot write %s: %s", version, ready.staging_file, err
            )
            self._abort_quietly(ready.push_id)
            return None
        except BaseException:
            self._abort_quietly(ready.push_id)
            raise
        return self._commit(ready.push_id, version)

    def _commit(self, push_id: int, version: int, checksums: tuple[int, ...] = ()) -> Committed:
        return self._await_commit(PushCommit(push_id, checksums=checksums), (), version)

    def _await_commit(self, message: Message, frames: Sequence[Part], version: int) -> Committed:
        """Send the message that commits `version` and wait for `Committed`."""
        try:
            reply = self._call(
                message, frames, expect=Committed, timeout_s=self.commit_timeout_s, retry=False
            )
        except ProtocolTimeoutError:
            # The commit may have happened with its reply lost: the server knows.
            latest = self.latest()
            if latest is not None and latest >= version:
                return Committed(version=version, persisted=False)
            raise
        assert isinstance(reply.message, Committed)
        return reply.message

    def _abort_quietly(self, push_id: int) -> None:
        try:
            self._rpc.call(PushAbort(push_id), timeout_s=min(1.0, self.timeout_s), retry=False)
        except Exception:  # the push is dead either way; its server side expires on its own
            self._rpc.reset()

    # ------------------------------------------------------------------ pull

    def pull(
        self, version: int | Literal["latest"] = "latest", *, if_newer_than: int | None = None
    ) -> PulledWeights | None:
        """Pull one consistent version (the latest, or `version`).

        Returns None when `if_newer_than` is given and the server has nothing newer.
        Raises `VersionNotFoundError` when the version is not held.
        """
        wanted = None if version == "latest" else int(version)
        with self._lock:
            for attempt in range(self._rpc.retries + 1):
                begin = PullBegin(
                    version=wanted,
                    if_newer_than=if_newer_than,
                    prefetch_bytes=self.message_bytes,
                    local=self.local,
                )
                granted = self._call(begin, expect=(PullGranted, NotNewer))
                if isinstance(granted.message, NotNewer):
                    return None
                lease = granted.message
                assert isinstance(lease, PullGranted)
                if lease.state_file and granted.frames:
                    raise MalformedMessageError("PullGranted names a state file and carries frames")
                mapped = map_granted_version(lease, verify=self.verify) if lease.state_file else None
                if mapped is not None:
                    self._end_quietly(lease.lease_id)
                    return PulledWeights(mapped, lease.version, dict(lease.metadata), mapped=True)
                try:
                    # The lease ends on the server once every frame was sent: no PullEnd round trip.
                    tree = self._fetch(lease, granted.frames)
                except LeaseExpiredError:
                    if attempt == self._rpc.retries:
                        raise
                    time.sleep(self._rpc.backoff(attempt))
                    continue
                except BaseException:
                    self._end_quietly(lease.lease_id)
                    raise
                return PulledWeights(tree=tree, version=lease.version, metadata=dict(lease.metadata))
        raise AssertionError("unreachable")

    def _fetch(self, lease: PullGranted, prefetched: list[zmq.Frame]) -> dict[str, Any]:
        """Fetch every frame of a leased version; tensors are joined and verified as they arrive."""
        assembler = TreeAssembler(lease.manifest, verify=self.verify)
        if len(prefetched) != lease.first_frames:
            raise MalformedMessageError(
                f"PullGranted announces {lease.first_frames} frames, {len(prefetched)} attached"
            )
        assembler.add(0, prefetched)
        sizes = [s.nbytes for s in frame_layout(lease.manifest)]
        start = lease.first_frames
        runs = [
            (start + first, count) for first, count in split_into_messages(sizes[start:], self.message_bytes)
        ]
        requests: list[tuple[Message, Sequence[Part]]] = [
            (FetchChunks(lease.lease_id, first, count), ()) for first, count in runs
        ]

        def received(index: int, reply: Reply) -> None:
            first, count = runs[index]
            chunk = reply.message
            if not isinstance(chunk, Chunks) or chunk.first_frame != first or len(reply.frames) != count:
                raise MalformedMessageError(
                    f"bad reply to FetchChunks({first}, {count}): {chunk!r} with {len(reply.frames)} frames"
                )
            assembler.add(first, reply.frames)

        self._pipeline(requests, "FetchChunks", received)
        return unflatten_tree(assembler.result())

    def _end_quietly(self, lease_id: int) -> None:
        try:
            self._rpc.call(PullEnd(lease_id), timeout_s=min(2.0, self.timeout_s), retry=False)
        except (ProtocolTimeoutError, RemoteError):
            pass  # the lease expires on the server by itself

    # ------------------------------------------------------------------ queries

    def latest(self) -> int | None:
        """The newest committed version, or None when there is none."""
        with self._lock:
            reply = self._call(LatestQuery(), expect=LatestVersion).message
            assert isinstance(reply, LatestVersion)
            return reply.version

    def wait_for_newer(self, version: int | None, timeout: float) -> int | None:
        """Block until a version newer than `version` commits (long-poll); returns it, or None on timeout."""
        deadline = Deadline(timeout)
        with self._lock:
            while True:
                wait_s = min(deadline.remaining(), 30.0)
                reply = self._call(
                    WaitNewer(version=version, timeout_ms=int(wait_s * 1000)),
                    expect=LatestVersion,
                    timeout_s=wait_s + self.timeout_s,
                ).message
                assert isinstance(reply, LatestVersion)
                if reply.version is not None and (version is None or reply.version > version):
                    return reply.version
                if deadline.expired():
                    return None

    def stat(self) -> ServerStats:
        """Versions held, bytes, clients, pulls in flight, pending pushes, persistence state."""
        with self._lock:
            reply = self._call(StatQuery(), expect=ServerStats).message
            assert isinstance(reply, ServerStats)
            return reply
