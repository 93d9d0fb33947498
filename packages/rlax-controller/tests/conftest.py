"""Small real peers for controller tests: a protocol-speaking generation server and a
deterministic prompt source (stand-ins for the inference worker and the data package)."""

from __future__ import annotations

import pathlib
import sys
import threading
import uuid
from typing import Any

import pytest
import zmq

from rlax_controller.rollout_scheduler import PromptItem
from rlax_core.testing import LoopThread
from rlax_protocol.messages import ErrorReply, GenerateRequest, GenerateResult, Hello, Sample
from rlax_protocol.ports import reserve_port
from rlax_protocol.transport import parse_request, reply_parts, welcome_for

# --import-mode=importlib does not put test folders on sys.path; our helpers live here.
_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def free_port() -> int:
    return reserve_port()


class CountingSource:
    """Prompts p0, p1, ... (a deterministic stream whose state is its cursor)."""

    def __init__(self) -> None:
        self.cursor = 0

    def next_prompt(self) -> PromptItem:
        item = PromptItem(f"p{self.cursor}", (1, 2 + self.cursor % 5), record=self.cursor)
        self.cursor += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])


class ParityScorer:
    """Reward 1 when the first completion token is even."""

    def score(self, item: PromptItem, completions: Any) -> list[tuple[float, bool]]:
        return [(float(c[0] % 2 == 0), c[0] % 2 == 0) for c in completions]


class FakeWorker:
    """A ROUTER server in a thread answering GenerateRequest with seeded tokens at the
    version it names (pinned), else at `version`."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.version = 0
        self.server_id = uuid.uuid4().hex[:8]
        self.served = 0
        self.paused = threading.Event()
        self.swallow = False  # answer Hello but never GenerateRequest (a hung engine)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(self.address)
        try:
            while not self._stop.is_set():
                if self.paused.is_set() or not sock.poll(20):
                    self._stop.wait(0.01)
                    continue
                request = parse_request(sock.recv_multipart(copy=False))
                msg = request.message
                if isinstance(msg, Hello):
                    reply: Any = welcome_for(msg, server_id=self.server_id)
                elif isinstance(msg, GenerateRequest) and self.swallow:
                    continue
                elif isinstance(msg, GenerateRequest):
                    seed = msg.sampling.seed or 0
                    samples = tuple(
                        Sample(
                            token_ids=((seed + i) % 7 + 3, 4), logprobs=(-0.5, -0.25), finish_reason="stop"
                        )
                        for i in range(msg.n)
                    )
                    # A real worker generates a pinned request with exactly its version.
                    version = self.version if msg.weight_version is None else msg.weight_version
                    reply = GenerateResult(request_id=msg.request_id, samples=samples, weight_version=version)
                    self.served += 1
                else:
                    reply = ErrorReply(code="unknown_message", message=type(msg).__name__)
                sock.send_multipart(reply_parts(request.identity, request.request_id, reply))
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def fake_workers():
    made: list[FakeWorker] = []

    def make(n: int) -> list[FakeWorker]:
        for _ in range(n):
            made.append(FakeWorker(f"tcp://127.0.0.1:{free_port()}"))
        return made[-n:]

    yield make
    for worker in made:
        worker.stop()


@pytest.fixture
def toy():
    """The stand-in classes, for tests to instantiate."""

    class Toy:
        Source = CountingSource
        Scorer = ParityScorer
        port = staticmethod(free_port)

    return Toy


@pytest.fixture
def loop_thread() -> type[LoopThread]:
    return LoopThread
