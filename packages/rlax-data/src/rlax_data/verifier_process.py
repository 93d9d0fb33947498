"""`rlax-verifier`: verification as a ZeroMQ service, so scoring scales out to other hosts.

The service is served by `rlax_protocol.RpcServer` with a batch handler. A client says
`Hello`, then sends either

* a batch (what `RemoteVerifier` sends): a `VerifyBatch` header (`items`: how many),
  followed by one raw frame holding the JSON array of ``[completion, record]`` pairs
  (a `Record` as JSON; its `task` names the verifier route). The reply is a
  `VerifyBatchResult` header (`refused`: how many items were not scored) followed by one
  raw frame holding the JSON array of per-item outcomes ``[reward, correct, details,
  code, error]`` (trailing defaults left out; a non-empty ``code`` means that item was
  refused and says why);
* or single `VerifyRequest`s, pipelined, each answered with its own `VerifyResult`
  (or `ErrorReply`);
* or `EnvStepRequest`s, the workers' multi-turn environment steps (`agent.where:
  service`), each answered with an `EnvStepResult` (see `rlax_data.envs.remote`).

One message per item cost a round of encode, bounds check, decode and a socket hop
per completion, about 40x the in-process cost of an exact match; a batch costs one.
Each time the server wakes it drains the messages already waiting (up to
`max_batch`); a client's waiting items are scored together, one batch per verifier
route, as many at a time as its turn allows, and a message's sandboxed items run as
one batch, so the code sandbox runs its programs in parallel. An item whose record is
malformed, names no served route, or is refused by its verifier fails alone (see
`VerifierService`); a message that cannot be read at all gets an `ErrorReply`. No
message, however hostile, stops the server, and every receive has a timeout.

The parts: `verifier_wire` (the messages' frames, and how a single `VerifyRequest` maps
onto a record), `verifier_service` (`VerifierService`: admission and where the work
runs), `verifier_scoring` (scoring by route, the replies), `verifier_env_steps`
(environment steps) and `remote_verifier` (`RemoteVerifier`, the client). This module
is the `rlax-verifier` command line, and re-exports the names callers import from it.

What a client asks for is bounded by the service, not the client: see `VerifierService`
for each limit, and for how one client's slow work (sandboxed programs, environment
steps, a long batch) is kept from delaying another's.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import yaml

from rlax_data.remote_verifier import RemoteVerifier
from rlax_data.verifier_service import VERIFIER_PERMISSIONS, VerifierService
from rlax_data.verifier_wire import (
    DEFAULT_ADDRESS,
    MAX_BATCH_BYTES,
    MAX_BATCH_ITEMS,
    RETRY_AFTER_S,
    decode_batch,
    encode_batch,
    request_to_item,
)
from rlax_data.verify.answers import ExactMatchConfig, MathConfig
from rlax_data.verify.code import CodeConfig
from rlax_data.verify.countdown import CountdownConfig
from rlax_data.verify.registry import (
    LeafConfig,
    RoutingConfig,
    RoutingVerifier,
    build_verifier,
    load_verifier_config,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_ITEMS",
    "RETRY_AFTER_S",
    "VERIFIER_PERMISSIONS",
    "RemoteVerifier",
    "VerifierService",
    "decode_batch",
    "default_routes",
    "encode_batch",
    "main",
    "request_to_item",
]

log = logging.getLogger("rlax_data.verifier_process")


class _ConfiguredVerifier(Protocol):
    """A leaf verifier and the config it was built from, as every built-in task's is (the
    `Task` protocol only promises a `Verifier`)."""

    config: LeafConfig


def default_routes() -> RoutingConfig:
    """Routes served when no config is given: the general verifiers, and every built-in task
    under its name with the verifier the task itself uses (so a run scores the same with
    `verifier.mode: local` and `service`)."""
    from rlax_data.tasks import TASK_NAMES, make_task

    general: dict[str, Any] = {
        "math": MathConfig(),
        "exact_match": ExactMatchConfig(),
        "countdown": CountdownConfig(),
        "code": CodeConfig(),
    }
    tasks = {name: cast(_ConfiguredVerifier, make_task(name).verifier()).config for name in TASK_NAMES}
    return RoutingConfig(routes={**general, **tasks})


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
    parser.add_argument(
        "--batch-window-s",
        type=float,
        default=0.0,
        help="after a request arrives, wait this long for more to score with it (default: none)",
    )
    parser.add_argument(
        "--code-threads",
        type=int,
        default=2,
        help="sandboxed batches run at once (each runs its route's sandbox.workers programs at once)",
    )
    parser.add_argument(
        "--max-timeout-s",
        type=float,
        default=60.0,
        help="the longest an environment step may run, whatever its request asks (default 60)",
    )
    parser.add_argument(
        "--max-pending-per-client",
        type=int,
        default=64,
        help="messages one client may have waiting or running; more are answered busy (default 64)",
    )
    parser.add_argument(
        "--environment",
        action="append",
        default=[],
        metavar="PACKAGE.MODULE:FACTORY",
        help="also serve this environment for multi-turn rollouts (registered ones always are)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlax-verifier %(levelname)s %(message)s")
    cfg = _load_config(args.config)
    verifier = build_verifier(cfg)
    assert isinstance(verifier, RoutingVerifier)
    service = VerifierService(
        verifier,
        address=args.bind,
        max_batch=args.max_batch,
        batch_window_s=args.batch_window_s,
        poll_s=args.poll_s,
        env_paths=args.environment,
        code_threads=args.code_threads,
        max_timeout_s=args.max_timeout_s,
        max_pending_per_client=args.max_pending_per_client,
    )
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    # Each batch decodes thousands of records that survive into the oldest GC generation
    # until it is answered, so full collections come every few batches; freezing what
    # start-up built keeps them from rescanning it (about 40% of an exact-match batch).
    gc.freeze()
    # The bound address (a random port when asked for :0) is the first line on stdout.
    print(service.bound_address, flush=True)
    log.info("serving routes %s", sorted(verifier.routes))
    try:
        service.serve()
    finally:
        service.close()
    log.info("stopped after %s", {**service.stats, **service.envs.stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
