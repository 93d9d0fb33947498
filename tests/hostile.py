"""Attacks on a live run's control plane, played from outside it (issue 29): a stranger with
no key, a process of an earlier run, and one of the run's own workers sending what only the
trainer may send. Each must be refused without changing the run; `attack_run` returns what
each attempt got, for the test to check beside the run's trajectory."""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
from typing import Any

import yaml

import rlax_protocol as rp
from rlax_protocol.auth import CREDENTIAL_ENV, Credential, RunKeys
from rlax_protocol.control_messages import BatchRequest, StatusQuery, decode_control, encode_control
from rlax_protocol.procfs import memory_mb
from rlax_protocol.request_links import ControlClient

ATTEMPT_TIMEOUT_S = 5.0
"""How long a stranger's attempt waits: a refusal at connect is silence, so it waits all of it."""
ANSWER_TIMEOUT_S = 30.0
"""How long an attempt with the run's own credential waits for its (refusal) answer: the
server is live and must answer, but on a loaded 2-core machine a worker that is compiling
took more than 5 s (in the full suite it read as 'refused at connect')."""


def credential_of(out: pathlib.Path, name: str) -> Credential:
    """The credential a running component of the run holds, read from its environment (the
    same user may read it; that is what a compromised worker would have)."""
    starts = [json.loads(line) for line in (out / "logs" / "events.jsonl").read_text().splitlines()]
    pid = [e["pid"] for e in starts if e["event"] == "start" and e["name"] == name][-1]
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for entry in environ:
        key, _, value = entry.partition(b"=")
        if key.decode() == CREDENTIAL_ENV:
            return Credential.from_json(value.decode())
    raise AssertionError(f"{name} (pid {pid}) holds no {CREDENTIAL_ENV}")


def _outcome(call: Any) -> str:
    """``ok``, ``refused at connect`` (no answer at all) or the error code of the answer."""
    try:
        call()
    except rp.ProtocolTimeoutError:
        return "refused at connect"
    except rp.RemoteError as error:
        return error.code
    return "ok"


def _closing_call(client: Any, message: Any) -> Any:
    try:
        return client.call(message)
    finally:
        client.close()


def _timeout_s(credential: Credential | None, inside: Credential) -> float:
    return ANSWER_TIMEOUT_S if credential is inside else ATTEMPT_TIMEOUT_S


def _controller(address: str, credential: Credential | None, timeout_s: float) -> ControlClient:
    return ControlClient(
        address,
        encode=encode_control,
        decode=decode_control,
        timeout_s=timeout_s,
        credential=credential,
    )


def _rpc(address: str, credential: Credential | None, timeout_s: float) -> rp.RpcClient:
    return rp.RpcClient(address, timeout_s=timeout_s, retries=0, credential=credential)


def attack_run(out: pathlib.Path) -> dict[str, str]:
    """Play every attack once against the run in `out`; returns attack -> outcome."""
    config = yaml.safe_load((out / "config.yaml").read_text())
    controller = config["controller"]["address"]
    paramserver = config["paramserver"]["address"]
    worker = config["workers"]["addresses"][0]
    mechanism = credential_of(out, "worker0").mechanism
    earlier_run = RunKeys.generate(mechanism).credential("trainer")
    inside = credential_of(out, "worker1")  # a worker of this run, turned hostile
    rewind = BatchRequest(trainer_step=1, trainer_id="stranger")
    manifest = rp.TensorManifest(protocol_version=rp.PROTOCOL_VERSION, chunk_bytes=1024, tensors=())
    generate = rp.GenerateRequest(
        request_id="hostile", prompt_token_ids=(1, 2), sampling=rp.SamplingParams(max_tokens=4), n=1
    )
    attempts = {
        "controller BatchRequest": lambda c: _outcome(
            lambda: _closing_call(_controller(controller, c, _timeout_s(c, inside)), rewind)
        ),
        "paramserver PushBegin": lambda c: _outcome(
            lambda: _closing_call(
                _rpc(paramserver, c, _timeout_s(c, inside)), rp.PushBegin(version=10**6, manifest=manifest)
            )
        ),
        "worker GenerateRequest": lambda c: _outcome(
            lambda: _closing_call(_rpc(worker, c, _timeout_s(c, inside)), generate)
        ),
    }
    status = lambda: _outcome(  # noqa: E731
        lambda: _closing_call(_controller(controller, inside, ANSWER_TIMEOUT_S), StatusQuery())
    )
    # The run's own (hostile) worker first: its answers are quick, and the run must still be
    # live for the strangers' attempts to mean anything, so all of them run at once and the
    # run is asked again afterwards ("refused at connect" from a server that is gone proves nothing).
    outcomes = {f"worker: {what}": attempt(inside) for what, attempt in attempts.items()}
    outcomes["worker: controller StatusQuery"] = status()
    strangers = {"stranger": None, "earlier run": earlier_run}
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = {
            f"{who}: {what}": pool.submit(attempt, credential)
            for who, credential in strangers.items()
            for what, attempt in attempts.items()
        }
        outcomes.update({name: future.result() for name, future in futures.items()})
    outcomes["run still live after the strangers"] = status()
    secret = (inside.secret or inside.client_secret).encode()
    written = [p for p in out.rglob("*") if p.is_file() and secret in p.read_bytes()]
    outcomes["secrets written in the run folder"] = ", ".join(str(p) for p in written) or "none"
    return outcomes


EXPECTED = {
    **{
        f"{who}: {what}": "refused at connect"
        for who in ("stranger", "earlier run")
        for what in ("controller BatchRequest", "paramserver PushBegin", "worker GenerateRequest")
    },
    "worker: controller BatchRequest": "forbidden",
    "worker: paramserver PushBegin": "forbidden",
    "worker: worker GenerateRequest": "forbidden",
    "worker: controller StatusQuery": "ok",
    "secrets written in the run folder": "none",
    "run still live after the strangers": "ok",
}
"""What every attack must get."""


def _rss_mb(pid: int) -> float:
    return memory_mb(pid, "VmRSS") or 0.0


def _pids(out: pathlib.Path) -> dict[str, int]:
    events = [json.loads(line) for line in (out / "logs" / "events.jsonl").read_text().splitlines()]
    return {e["name"]: e["pid"] for e in events if e["event"] == "start"}


def flood_run(out: pathlib.Path, messages: int = 12, megabytes: int = 100) -> dict[str, float]:
    """Send `messages` messages of `megabytes` MB from as many unauthenticated connections
    to every server of the run at once; returns server -> rise of its RSS (MB) over the
    next 3 s (peak minus before)."""
    import time

    import zmq

    config = yaml.safe_load((out / "config.yaml").read_text())
    servers = {
        "controller": config["controller"]["address"],
        "paramserver": config["paramserver"]["address"],
        "verifier": config["verifier"]["address"],
        "worker0": config["workers"]["addresses"][0],
    }
    pids = _pids(out)
    payload = b"\x01" * (megabytes * 1024 * 1024)
    context = zmq.Context()
    sockets = []
    before = {name: _rss_mb(pids[name]) for name in servers}
    peak = dict(before)
    try:
        for address in servers.values():
            for _ in range(messages):
                sock = context.socket(zmq.DEALER)
                sock.linger = 0
                sock.sndtimeo = 0
                sock.connect(address)
                try:
                    sock.send_multipart([b"\0" * 8, payload], copy=False)
                except zmq.Again:
                    pass  # not even connected: nothing reaches the server
                sockets.append(sock)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            for name in servers:
                peak[name] = max(peak[name], _rss_mb(pids[name]))
            time.sleep(0.05)
    finally:
        for sock in sockets:
            sock.close(0)
        context.term()
    return {name: round(peak[name] - before[name], 1) for name in servers}
