"""One model spread over several parameter-server shards.

Each tensor lives on shard ``xxh3_64(name) % n_shards`` — a hash that is the same in
every process and run — and every shard holds every version (a shard with no tensor
gets an empty tree), so a version is complete when all shards committed it. Pushes and
pulls run on all shards in parallel, one thread and one `ParamClient` per shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import xxhash

from rlax_paramserver.client import ParamClient, PulledWeights, VersionNotFoundError
from rlax_protocol import Committed, Deadline, ServerStats, flatten_tree, unflatten_tree

T = TypeVar("T")


def shard_of(name: str, n_shards: int) -> int:
    """The shard a tensor path belongs to (stable across processes and runs)."""
    return xxhash.xxh3_64_intdigest(name.encode()) % n_shards


class ShardedParamClient:
    """A `ParamClient` look-alike over `addresses` (one per shard); keyword arguments go to each client."""

    def __init__(self, addresses: Sequence[str], **client_kwargs: Any) -> None:
        if not addresses:
            raise ValueError("ShardedParamClient addresses=[]: needs at least one shard")
        self.addresses = list(addresses)
        self.clients = [ParamClient(a, **client_kwargs) for a in self.addresses]
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="paramshard")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close()

    def __enter__(self) -> ShardedParamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _all(self, fn: Callable[[ParamClient], T]) -> list[T]:
        return list(self._pool.map(fn, self.clients))

    def push(
        self, tree: Mapping[str, Any], version: int, metadata: Mapping[str, Any] | None = None
    ) -> list[Committed]:
        """Push each shard's part of `tree` as `version`, all shards in parallel."""
        parts: list[dict[str, Any]] = [{} for _ in self.clients]
        for name, array in flatten_tree(tree).items():
            parts[shard_of(name, len(self.clients))][name] = array
        subtrees = [unflatten_tree(p) for p in parts]
        return list(
            self._pool.map(
                lambda i: self.clients[i].push(subtrees[i], version, metadata), range(len(self.clients))
            )
        )

    def latest(self) -> int | None:
        """The newest version every shard has committed."""
        versions = self._all(lambda c: c.latest())
        return None if any(v is None for v in versions) else min(v for v in versions if v is not None)

    def pull(
        self,
        version: int | Literal["latest"] = "latest",
        *,
        if_newer_than: int | None = None,
        attempts: int = 3,
    ) -> PulledWeights | None:
        """Pull one version from every shard in parallel and join the trees."""
        for attempt in range(attempts):
            wanted = self.latest() if version == "latest" else int(version)
            if wanted is None:
                raise VersionNotFoundError(
                    "not_found", "no version is committed on every shard", peer=str(self.addresses)
                )
            if if_newer_than is not None and wanted <= if_newer_than:
                return None
            try:
                pulled = self._all(functools.partial(ParamClient.pull, version=wanted))
            except VersionNotFoundError:
                # Freed on some shard between latest() and the pull: try the newer one.
                if version != "latest" or attempt == attempts - 1:
                    raise
                continue
            flat: dict[str, Any] = {}
            for part in pulled:
                assert part is not None
                flat.update(flatten_tree(part.tree))
            first = pulled[0]
            assert first is not None
            return PulledWeights(
                tree=unflatten_tree(dict(sorted(flat.items()))), version=wanted, metadata=first.metadata
            )
        raise AssertionError("unreachable")

    def wait_for_newer(self, version: int | None, timeout: float) -> int | None:
        """Block until every shard committed a version newer than `version`; None on timeout."""
        deadline = Deadline(timeout)
        for client in self.clients:
            if client.wait_for_newer(version, deadline.remaining()) is None:
                return None
        return self.latest()

    def stat(self) -> list[ServerStats]:
        return self._all(lambda c: c.stat())
