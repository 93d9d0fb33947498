"""RLAX parameter server: a versioned, atomic, concurrent and persistent weight store (no JAX).

Server: `ParamServer(ServerConfig(...))` or the `rlax-paramserver` command.
Client: `ParamClient(address, timeout_s=...)` with `push`, `pull`, `latest`,
`wait_for_newer`, `stat`; `ShardedParamClient([addresses])` spreads one model over shards.
Tests of other packages: `rlax_paramserver.testing.running_server(tmp_path)`.
"""

from rlax_paramserver.client import (
    LeaseExpiredError,
    ParamClient,
    PulledWeights,
    StaleVersionError,
    VersionNotFoundError,
)
from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import CorruptStateError
from rlax_paramserver.server import ParamServer
from rlax_paramserver.sharded import ShardedParamClient, shard_of

__all__ = [
    "CorruptStateError",
    "LeaseExpiredError",
    "ParamClient",
    "ParamServer",
    "PulledWeights",
    "ServerConfig",
    "ShardedParamClient",
    "StaleVersionError",
    "VersionNotFoundError",
    "shard_of",
]
