"""Environment steps in the verifier service: the workers' multi-turn environments
(`agent.where: service`) run here, each step in the service's environment pool."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

import rlax_protocol as rp
from rlax_data.envs.remote import EnvStepServer
from rlax_data.verifier_wire import BadRequest
from rlax_protocol.rpc_server import BatchResult


def env_step_job(
    envs: EnvStepServer,
    request: rp.EnvStepRequest,
    frames: list[zmq.Frame],
    *,
    max_env_turns: int,
    max_timeout_s: float,
) -> Callable[[], BatchResult]:
    """The work of answering `request`, to run in a pool thread. Raises `BadRequest` at
    once for a request the service refuses; a timeout beyond `max_timeout_s` is clamped
    (a run's workers ask from settings the service does not see), and the step's
    ``timeout`` error then names both."""
    if frames:
        raise BadRequest("malformed", f"an EnvStepRequest takes no raw frames, got {len(frames)}")
    if len(request.turns) > max_env_turns:
        raise BadRequest(
            "too_large",
            f"EnvStepRequest.turns: {len(request.turns)} turns, the service's max_env_turns is "
            f"{max_env_turns}",
        )
    asked = request.timeout_s
    if asked > max_timeout_s:
        request = msgspec.structs.replace(request, timeout_s=max_timeout_s)
    arrived = time.monotonic()

    def step() -> BatchResult:
        # The request's time runs from its arrival: waiting for a thread counts.
        reply = envs.answer(request, envs.submit(request), request.timeout_s - (time.monotonic() - arrived))
        if asked > request.timeout_s and isinstance(reply, rp.RemoteError) and reply.code == "timeout":
            reply = rp.RemoteError(
                "timeout",
                f"{reply.remote_message} (the service's max_timeout_s={max_timeout_s:g}; "
                f"the request asked {asked:g}s)",
            )
        return reply

    return step
