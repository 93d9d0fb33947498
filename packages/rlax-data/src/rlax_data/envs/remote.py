"""Environments run in the verifier service: the workers' agent loops scale out.

With `agent.where: service` a worker's environment steps go to the run's `rlax-verifier`
as `EnvStepRequest`s instead of running in the worker's threads (a Python tool's sandbox
then runs on the verifier's host, not beside the engine).

The request carries the whole trajectory (the record and every model turn so far), and
the service makes a fresh environment for it, resets it, replays the earlier turns and
answers the last one. So the service keeps no session: any replica can serve any step, a
restarted service loses nothing, and the answer equals what the same environment gives
in the worker. Environments whose steps do not depend on the earlier ones say so with
`independent_steps = True` (`ToolEnvironment` without a judge does) and are not replayed;
the calculator, which judges its tool use from every call's result, is.

What a stranger's request can choose is bounded: only registered environments, or the
`package.module:factory` paths the service was started with, are made; the options are
the three every factory takes (the format is made here, from its name and the calls a
turn may hold), typed and checked; the record is decoded with msgspec
(depth and size errors are refusals); and the whole request is bounded by its
`timeout_s`: a step that overruns it is abandoned, its answer dropped, and its thread slot
goes to the next request at once (`rlax_core.deadline_threads`), so hung environments
never shrink how many steps the service runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection
from concurrent.futures import Future

import msgspec

import rlax_protocol as rp
from rlax_core.deadline_threads import DeadlineThreads, Overloaded
from rlax_data.datasets import Record
from rlax_data.envs.environment import EnvStep

__all__ = ["EnvOptions", "EnvStepServer", "RemoteEnvironment", "RemoteEnvironments"]


class EnvOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The keyword options every environment factory takes (`EnvStepRequest.options`):
    the tool format by name (made with `max_calls_per_turn` as its `max_calls`) and the
    tool limits."""

    format: str = "hermes"
    max_calls_per_turn: int = 1
    max_result_chars: int = 4096
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_calls_per_turn <= 64:
            raise ValueError(f"max_calls_per_turn={self.max_calls_per_turn}: must be in [1, 64]")
        if not 1 <= self.max_result_chars <= 1 << 20:
            raise ValueError(f"max_result_chars={self.max_result_chars}: must be in [1, 1048576]")
        if not 0 < self.tool_timeout_s <= 600:
            raise ValueError(f"tool_timeout_s={self.tool_timeout_s}: must be in (0, 600]")


class EnvStepServer:
    """The service side: answers `EnvStepRequest`s, at most `threads` at once.

    allowed_paths: `package.module:factory` environments this service may import (the
    run's `agent.environment`); registered names are always served. max_abandoned: how
    many overrun steps may still run before new ones are refused (`busy`).
    """

    def __init__(
        self, *, threads: int = 8, allowed_paths: Collection[str] = (), max_abandoned: int = 256
    ) -> None:
        self._threads = DeadlineThreads(threads, max_abandoned=max_abandoned, name="rlax-env-service")
        self.allowed_paths = frozenset(allowed_paths)
        self.stats = {"env_steps": 0, "env_replayed_turns": 0, "env_errors": 0}

    @property
    def abandoned(self) -> int:
        """Steps that overran and whose threads still run."""
        return self._threads.abandoned

    def submit(self, request: rp.EnvStepRequest) -> Future[rp.EnvStepResult]:
        return self._threads.submit(lambda: self._step(request))

    def answer(
        self, request: rp.EnvStepRequest, future: Future[rp.EnvStepResult], wait_s: float
    ) -> rp.EnvStepResult | rp.RemoteError:
        """The reply to `request`: its result, or a `RemoteError` naming what went wrong."""
        try:
            return future.result(timeout=max(wait_s, 0.0))
        except TimeoutError:
            self._threads.abandon(future)
            self.stats["env_errors"] += 1
            return rp.RemoteError(
                "timeout", f"environment {request.environment!r}: over {request.timeout_s}s"
            )
        except Overloaded as error:
            self.stats["env_errors"] += 1
            return rp.RemoteError("busy", f"environment {request.environment!r}: {error}")
        except rp.RemoteError as error:
            self.stats["env_errors"] += 1
            return error
        except Exception as error:  # the environment's own failure: the request fails alone
            self.stats["env_errors"] += 1
            return rp.RemoteError(
                "env_failed", f"environment {request.environment!r}: {type(error).__name__}: {error}"[:500]
            )

    def close(self) -> None:
        self._threads.close()

    def _step(self, request: rp.EnvStepRequest) -> rp.EnvStepResult:
        from rlax_data.envs import environment_names, make_environment, make_tool_format

        name = request.environment
        if name not in environment_names() and name not in self.allowed_paths:
            raise rp.RemoteError(
                "not_found", f"environment {name!r}: not one of {environment_names()} or the service's paths"
            )
        try:
            options = msgspec.json.decode(request.options, type=EnvOptions)
            record = msgspec.json.decode(request.record, type=Record)
        except (msgspec.DecodeError, RecursionError, ValueError) as error:
            raise rp.RemoteError(
                "malformed", f"EnvStepRequest: {type(error).__name__}: {error}"[:500]
            ) from None
        env = make_environment(
            name,
            format=make_tool_format(options.format, max_calls=options.max_calls_per_turn),
            max_result_chars=options.max_result_chars,
            tool_timeout_s=options.tool_timeout_s,
        )
        env.reset(record)
        earlier = request.turns[:-1]
        if not getattr(env, "independent_steps", False):
            for turn in earlier:
                env.step(turn)
            self.stats["env_replayed_turns"] += len(earlier)
        step = env.step(request.turns[-1])
        self.stats["env_steps"] += 1
        return rp.EnvStepResult(
            request_id=request.request_id,
            observation=str(step.observation),
            done=bool(step.done),
            reward=None if step.reward is None else float(step.reward),
            tool_calls=int(step.tool_calls),
            tool_errors=int(step.tool_errors),
            error=str(step.error),
            tool_correct=None if getattr(step, "tool_correct", None) is None else bool(step.tool_correct),
        )


class RemoteEnvironments:
    """Makes `RemoteEnvironment`s that talk to the service at `address`; every thread that
    steps one gets a client of its own (ZeroMQ sockets are not shared between threads)."""

    def __init__(self, address: str, *, options: EnvOptions, timeout_s: float) -> None:
        self.address = address
        self.options_json = msgspec.json.encode(options).decode()
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._clients: list[rp.RpcClient] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def make(self, name: str) -> RemoteEnvironment:
        return RemoteEnvironment(self, name)

    def call(self, request: rp.EnvStepRequest) -> rp.EnvStepResult:
        """The service's answer; one retry after a timeout (a step is idempotent: the service
        replays it from the record), so a worker waits at most about 2 x `timeout_s`, the
        agent loop's own limit of an environment step."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = rp.RpcClient(self.address, timeout_s=self.timeout_s + 1.0, retries=1, role="env-client")
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        reply = client.call(request, expect=rp.EnvStepResult).message
        assert isinstance(reply, rp.EnvStepResult)
        if reply.request_id != request.request_id:
            raise rp.MalformedMessageError(
                f"the service answered EnvStepRequest {request.request_id!r} as {reply.request_id!r}"
            )
        return reply

    def next_id(self) -> str:
        return f"env-{next(self._ids)}"

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()


class RemoteEnvironment:
    """One trajectory's environment, stepped in the service (`rlax_data.envs.Environment`).

    `reset` only keeps the record: the service resets its own environment at every step.
    (The first observation, the prompt, is built where prompts are built, with a local
    environment of the same name.)"""

    def __init__(self, owner: RemoteEnvironments, name: str) -> None:
        self.name = name
        self._owner = owner
        self._record_json = ""
        self._turns: list[str] = []

    def reset(self, record: Record) -> str:
        self._record_json = msgspec.json.encode(record).decode()
        self._turns = []
        return ""

    def step(self, model_turn: str) -> EnvStep:
        if not self._record_json:
            raise RuntimeError(f"environment {self.name!r}: step before reset")
        turns = (*self._turns, model_turn)
        request = rp.EnvStepRequest(
            request_id=self._owner.next_id(),
            environment=self.name,
            record=self._record_json,
            turns=turns,
            options=self._owner.options_json,
            timeout_s=self._owner.timeout_s,
        )
        reply = self._owner.call(request)
        self._turns.append(model_turn)
        return EnvStep(
            reply.observation,
            done=reply.done,
            reward=reply.reward,
            tool_calls=reply.tool_calls,
            tool_errors=reply.tool_errors,
            error=reply.error,
            tool_correct=reply.tool_correct,
        )
