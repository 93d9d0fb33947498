"""`rlax-worker`: an inference worker process serving GenerateRequests over ZeroMQ.

Three threads, and only one of them runs the model:

- the I/O thread owns the ROUTER socket: it answers `Hello`, decodes `GenerateRequest`s
  into the inbox queue and sends whatever the compute loop puts in the outbox;
- the weights thread asks the parameter server for its latest version and, once the
  worker is `reload_staleness` (the paper's j) or more versions behind, pulls it and hands
  it over through a queue;
- the compute loop (the caller of `Worker.run`) swaps weights between engine steps,
  admits requests, steps the engine and queues `GenerateResult`s. It never touches a socket.

A request the engine refuses (prompt too long, token outside the vocabulary, ...) gets an
`ErrorReply(code="malformed")` naming the problem; the others keep being served.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import queue
import signal
import sys
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import zmq

import rlax_protocol as rp
from rlax_inference.engine import EngineConfig, LLMEngine, RequestOutput, SwapPolicy
from rlax_inference.sequence import FinishReason, SamplingParams
from rlax_model import ModelConfig, Params, dtype_policy
from rlax_paramserver import ParamClient

log = logging.getLogger("rlax_inference.worker")

# sysexits.h EX_CONFIG: `main` exits with it when the worker's config is rejected, as every
# rlax component does; `rlax launch` stops the run on it instead of restarting the worker.
EXIT_CONFIG_ERROR = 78


class WorkerConfigError(ValueError):
    """The worker's model or engine config is rejected (by itself or by the pulled weights)."""


_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


@dataclass(frozen=True)
class WorkerConfig:
    """Where the worker listens and how it follows the parameter server.

    bind: ZeroMQ address of the ROUTER socket (loopback by default; port * picks one).
    paramserver: address of the parameter server.
    reload_staleness: reload once the newest version is this many versions ahead (j >= 1).
    weights_poll_s: how often the weights thread asks for the latest version.
    first_weights_timeout_s: how long to wait for a first version before giving up.
    rpc_timeout_s: deadline of each parameter-server exchange and socket send.
    """

    bind: str = "tcp://127.0.0.1:*"
    paramserver: str = "tcp://127.0.0.1:5555"
    reload_staleness: int = 1
    weights_poll_s: float = 0.5
    first_weights_timeout_s: float = 120.0
    rpc_timeout_s: float = 30.0
    worker_id: str = "worker"

    def __post_init__(self) -> None:
        if not isinstance(self.reload_staleness, int) or self.reload_staleness < 1:
            raise ValueError(
                f"WorkerConfig.reload_staleness must be an int >= 1, got {self.reload_staleness!r}"
            )
        for name in ("weights_poll_s", "first_weights_timeout_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkerConfig.{name} must be > 0, got {getattr(self, name)!r}")


def to_engine_params(msg: rp.GenerateRequest) -> SamplingParams:
    """Protocol sampling settings -> engine `SamplingParams` (raises ValueError on bad values).

    A request without a seed gets one derived from its request id, so a retry reproduces it.
    """
    s = msg.sampling
    seed = s.seed if s.seed is not None else zlib.crc32(msg.request_id.encode())
    return SamplingParams(
        n=msg.n,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        seed=seed,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop_strings),
        logprobs=s.top_logprobs,
    )


def to_result(request_id: str, out: RequestOutput, *, with_logprobs: bool) -> rp.GenerateResult:
    samples = tuple(
        rp.Sample(
            token_ids=tuple(c.tokens),
            logprobs=tuple(c.logprobs) if with_logprobs else (),
            finish_reason=_FINISH[c.finish_reason],  # type: ignore[arg-type]
            top_logprobs=tuple(dict(t) for t in c.top_logprobs),
        )
        for c in out.outputs
    )
    version = out.weight_version
    return rp.GenerateResult(
        request_id=request_id, samples=samples, weight_version=-1 if version is None else version
    )


def params_from_tree(tree: dict[str, Any], dtype: Any = None) -> Params:
    """Pulled numpy tree -> device arrays (copies: pulled arrays are read-only views of frames),
    cast to `dtype` when given (the model config's `param_jnp_dtype` after `dtype_policy`)."""
    return jax.tree_util.tree_map(lambda a: jax.device_put(np.array(a, dtype=dtype)), tree)


@dataclass
class _Pending:
    identity: bytes
    transport_id: int
    request: rp.GenerateRequest


class Worker:
    """The worker: `start()` the I/O and weights threads, then `run()` the compute loop."""

    def __init__(
        self,
        config: WorkerConfig,
        engine_config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        detokenize: Any = None,
    ) -> None:
        self.config = config
        self.engine_config = engine_config
        self.model_config = model_config
        self.detokenize = detokenize
        self.engine: LLMEngine | None = None
        self.address: str | None = None
        self._inbox: queue.Queue[_Pending] = queue.Queue()
        self._outbox: queue.Queue[tuple[bytes, int, rp.Message]] = queue.Queue()
        self._weights: queue.Queue[tuple[Params, int]] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._threads: list[threading.Thread] = []
        self._version_seen = -1  # newest version handed to the compute loop (weights thread's view)
        self.num_weight_checks = 0
        self.num_reloads = 0
        self.errors: list[BaseException] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> str:
        """Pull the first weights, build the engine, start the threads; returns the bound address."""
        client = ParamClient(
            self.config.paramserver, timeout_s=self.config.rpc_timeout_s, client_id=self.config.worker_id
        )
        try:
            version = client.wait_for_newer(None, self.config.first_weights_timeout_s)
            if version is None:
                raise TimeoutError(
                    f"no weights on {self.config.paramserver} after {self.config.first_weights_timeout_s}s"
                )
            pulled = client.pull()
            assert pulled is not None
        finally:
            client.close()
        try:
            model_config = dtype_policy(self.model_config or _model_config_from(pulled.metadata))
            self.engine = LLMEngine(
                model_config, params_from_tree(pulled.tree, model_config.param_jnp_dtype), self.engine_config,
                weight_version=pulled.version, detokenize=self.detokenize,
            )  # fmt: skip
        except ValueError as e:  # e.g. max_model_len beyond the model's positions: a restart cannot help
            raise WorkerConfigError(str(e)) from None
        self.model_config = model_config
        self._version_seen = pulled.version
        for target, name in ((self._io_loop, "rlax-worker-io"), (self._weights_loop, "rlax-worker-weights")):
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if not self._bound.wait(self.config.rpc_timeout_s):
            self.stop()
            raise RuntimeError(f"I/O thread did not bind {self.config.bind}: {self.errors}")
        assert self.address is not None
        return self.address

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    def _guard(self, target: Any) -> Any:
        def run() -> None:
            try:
                target()
            except BaseException as e:  # a dead helper thread must stop the worker, loudly
                log.exception("%s failed", threading.current_thread().name)
                self.errors.append(e)
                self._stop.set()
                self._bound.set()

        return run

    # -- compute loop (no sockets here) ----------------------------------------------------
    def run(self) -> None:
        """Serve until `stop()` (or a helper thread fails, which re-raises here)."""
        engine = self.engine
        assert engine is not None, "call start() first"
        pending: dict[str, _Pending] = {}
        counter = 0
        while not self._stop.is_set():
            try:
                params, version = self._weights.get_nowait()
                engine.update_weights(params, version)
                self.num_reloads += 1
                log.info("weights v%d loaded", version)
            except queue.Empty:
                pass
            for item in self._drain_inbox(block=not engine.has_unfinished):
                counter += 1
                key = f"{counter}:{item.request.request_id}"
                try:
                    engine.add_request(key, item.request.prompt_token_ids, to_engine_params(item.request))
                except Exception as e:  # a request the engine refuses fails alone
                    if not isinstance(e, ValueError):
                        log.exception("request %r refused", item.request.request_id)
                    message = str(e).replace(f"request {key!r}", f"request {item.request.request_id!r}")
                    self._outbox.put(
                        (item.identity, item.transport_id, rp.ErrorReply(code="malformed", message=message))
                    )
                    continue
                pending[key] = item
            if engine.has_unfinished:
                for out in engine.step():
                    item = pending.pop(out.request_id)
                    result = to_result(
                        item.request.request_id, out, with_logprobs=item.request.sampling.logprobs
                    )
                    self._outbox.put((item.identity, item.transport_id, result))
        if self.errors:
            raise RuntimeError(f"worker stopped: {self.errors[0]!r}") from self.errors[0]

    def _drain_inbox(self, *, block: bool) -> list[_Pending]:
        items: list[_Pending] = []
        try:
            items.append(self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            return items

    # -- I/O thread ------------------------------------------------------------------------
    def _io_loop(self) -> None:
        context = zmq.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            socket.bind(self.config.bind)
            self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bound.set()
            peers = rp.PeerRegistry()
            while not self._stop.is_set():
                while True:
                    try:
                        identity, transport_id, message = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    self._send(socket, identity, transport_id, message)
                if socket.poll(5, zmq.POLLIN):
                    self._serve_one(socket, socket.recv_multipart(zmq.NOBLOCK, copy=False), peers)
        finally:
            socket.close(linger=0)

    def _serve_one(self, socket: zmq.Socket[Any], parts: list[zmq.Frame], peers: rp.PeerRegistry) -> None:
        """One request: whatever it makes fail is answered with an `ErrorReply` (where the
        sender is known) and logged; the I/O thread, and so the worker, keeps serving."""
        try:
            self._handle(socket, rp.parse_request(parts), peers)
        except Exception as e:
            log.exception("error handling a request")
            if parts:
                reply = rp.ErrorReply(code="internal", message=f"{type(e).__name__}: {e}")
                self._send(socket, parts[0].bytes, 0, reply)

    def _send(self, socket: zmq.Socket[Any], identity: bytes, transport_id: int, message: rp.Message) -> None:
        try:
            rp.send_within(
                socket, rp.reply_parts(identity, transport_id, message),
                timeout_s=self.config.rpc_timeout_s, peer=identity.hex(), operation=type(message).__name__,
            )  # fmt: skip
        except (zmq.ZMQError, rp.ProtocolTimeoutError) as e:
            # The client went away; its result is lost, the worker goes on.
            log.warning("could not deliver %s to %s: %s", type(message).__name__, identity.hex(), e)

    def _handle(self, socket: zmq.Socket[Any], request: rp.Request, peers: rp.PeerRegistry) -> None:
        reply: rp.Message | None
        if request.error is not None:
            reply = rp.ErrorReply(code="malformed", message=str(request.error))
        elif isinstance(request.message, rp.Hello):
            reply = rp.welcome_for(request.message, server_id=self.config.worker_id)
            if reply.accepted:
                peers.admit(request.identity)
        elif not peers.touch(request.identity):
            reply = rp.ErrorReply(
                code="handshake_required", message="say Hello (with the protocol version) first"
            )
        elif isinstance(request.message, rp.GenerateRequest):
            self._inbox.put(_Pending(request.identity, request.request_id, request.message))
            reply = None  # answered when generation finishes
        else:
            name = type(request.message).__name__
            reply = rp.ErrorReply(
                code="unknown_message", message=f"{name} is not an inference-worker request"
            )
        if reply is not None:
            self._send(socket, request.identity, request.request_id, reply)

    # -- weights thread ----------------------------------------------------------------------
    def _weights_loop(self) -> None:
        client = ParamClient(
            self.config.paramserver, timeout_s=self.config.rpc_timeout_s, client_id=self.config.worker_id
        )
        try:
            while not self._stop.wait(self.config.weights_poll_s):
                try:
                    latest = client.latest()
                except rp.ProtocolTimeoutError as e:
                    log.warning("parameter server unreachable: %s", e)
                    continue
                self.num_weight_checks += 1
                if latest is None or latest - self._version_seen < self.config.reload_staleness:
                    continue
                pulled = client.pull(if_newer_than=self._version_seen)
                if pulled is None:
                    continue
                params = params_from_tree(pulled.tree, self.model_config.param_jnp_dtype)
                while not self._stop.is_set():
                    try:
                        self._weights.put((params, pulled.version), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                self._version_seen = pulled.version
        finally:
            client.close()


def _model_config_from(metadata: dict[str, Any]) -> ModelConfig:
    raw = metadata.get("model_config")
    if not isinstance(raw, dict):
        raise ValueError(
            "the pulled weights carry no metadata['model_config'] (a dict of ModelConfig fields); "
            "pass --model-config FILE.json"
        )
    return model_config_from_dict(raw, source="metadata['model_config']")


def model_config_from_dict(raw: dict[str, Any], *, source: str) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{source}: unknown ModelConfig fields {unknown}")
    return ModelConfig(**raw)


def _worker_from_args(args: argparse.Namespace) -> Worker:
    """The worker the command line describes; a rejected config raises `WorkerConfigError`."""
    try:
        model_config = None
        if args.model_config:
            model_config = model_config_from_dict(
                json.loads(args.model_config.read_text()), source=str(args.model_config)
            )
        engine_kwargs = json.loads(args.engine_config.read_text()) if args.engine_config else {}
        if not isinstance(engine_kwargs, dict):
            raise ValueError(f"{args.engine_config}: expected a JSON object of EngineConfig fields")
        if "eos_token_ids" in engine_kwargs and engine_kwargs["eos_token_ids"] is not None:
            engine_kwargs["eos_token_ids"] = tuple(engine_kwargs["eos_token_ids"])
        if "swap_policy" in engine_kwargs:
            engine_kwargs["swap_policy"] = SwapPolicy(engine_kwargs["swap_policy"])
        return Worker(
            WorkerConfig(
                bind=args.bind, paramserver=args.paramserver, reload_staleness=args.reload_staleness,
                weights_poll_s=args.weights_poll_s, worker_id=args.worker_id,
            ),
            EngineConfig(**engine_kwargs),
            model_config,
        )  # fmt: skip
    except (ValueError, TypeError, OSError) as e:
        # TypeError: a field EngineConfig/ModelConfig lacks; OSError: an unreadable file.
        raise WorkerConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlax-worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--paramserver", required=True, help="parameter server address (tcp://host:port)")
    parser.add_argument("--bind", default="tcp://127.0.0.1:*", help="address to serve GenerateRequests on")
    parser.add_argument(
        "--reload-staleness", type=int, default=1, help="j: reload once this many versions behind"
    )
    parser.add_argument("--weights-poll-s", type=float, default=0.5)
    parser.add_argument(
        "--model-config", type=pathlib.Path, help="JSON of ModelConfig fields (default: pulled metadata)"
    )
    parser.add_argument("--engine-config", type=pathlib.Path, help="JSON of EngineConfig fields")
    parser.add_argument("--ready-file", type=pathlib.Path, help="write the bound address here once serving")
    parser.add_argument("--worker-id", default="worker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        worker = _worker_from_args(args)
        address = worker.start()
    except WorkerConfigError as e:
        print(f"rlax-worker: invalid config: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker._stop.set())
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(address)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(args.ready_file)
    log.info("serving on %s", address)
    try:
        worker.run()
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
