"""The trainer endpoint with real DEALER peers on loopback, driven from the test thread:
screening, error replies, and the held BatchRequest."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from loopback_peers import wait_until

from rlax_controller.run_tally import RunTally
from rlax_controller.trainer_endpoint import TrainerEndpoint
from rlax_core.config import load_config
from rlax_protocol.control_messages import (
    BatchRequest,
    NoBatchYet,
    RunComplete,
    RunStatus,
    StatusQuery,
    decode_control,
    encode_control,
)
from rlax_protocol.messages import PROTOCOL_VERSION, ErrorReply, Hello, Message, Welcome
from rlax_protocol.transport import pack_request_id


class Answers:
    """The controller's side: status from a fixed figure, batches once `ready`."""

    def __init__(self) -> None:
        self.ready = False
        self.restored = False
        self.fail = False
        self.asked: list[Message] = []

    def answer(self, message: Message) -> Message:
        self.asked.append(message)
        if self.fail:
            raise RuntimeError("the scheduler broke")
        if isinstance(message, StatusQuery):
            return RunStatus(step=3, total_steps=6, workers_alive=2, counters={}, finished=False)
        self.restored = True
        return RunComplete(final_step=0) if self.ready else NoBatchYet(reason="scoring", retry_after_s=0.02)


class Peer:
    """A DEALER that has said Hello; `ask` sends, `reply` pumps the endpoint until an answer comes."""

    def __init__(self, endpoint: TrainerEndpoint, address: str) -> None:
        self.endpoint = endpoint
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(address)
        self.next_id = 1
        self.ask(Hello(protocol_version=PROTOCOL_VERSION, client_id="trainer-test", role="trainer"))
        assert isinstance(self.reply(), Welcome)

    def ask(self, message: Message) -> None:
        self.send_raw(pack_request_id(self.next_id), encode_control(message))
        self.next_id += 1

    def send_raw(self, *parts: bytes) -> None:
        self.socket.send_multipart(list(parts))

    def reply(self, timeout_s: float = 10.0) -> Message:
        deadline = time.monotonic() + timeout_s
        while not self.socket.poll(5):
            assert time.monotonic() < deadline, "no reply"
            self.endpoint.serve()
        return decode_control(self.socket.recv_multipart()[1])

    def has_reply(self) -> bool:
        return bool(self.socket.poll(50))

    def close(self) -> None:
        self.socket.close(0)


@pytest.fixture
def endpoint(tmp_path: pathlib.Path, toy: Any) -> Iterator[tuple[TrainerEndpoint, Answers, Any]]:
    address = f"tcp://127.0.0.1:{toy.port()}"
    config = load_config(None, [f"run.output_dir={tmp_path / 'run'}", f"controller.address={address}"])
    answers = Answers()
    tally = RunTally({})
    made = TrainerEndpoint(
        config,
        context=zmq.Context.instance(),
        answer=answers.answer,
        may_hold=lambda: answers.restored,
        tally=tally,
    )
    peers: list[Peer] = []

    def peer() -> Peer:
        peers.append(Peer(made, address))
        return peers[-1]

    yield made, answers, peer
    for p in peers:
        p.close()
    made.close()


def test_a_screened_request_is_answered_by_the_controllers_answer(endpoint: Any) -> None:
    made, answers, peer = endpoint
    trainer = peer()
    trainer.ask(StatusQuery())
    status = trainer.reply()
    assert isinstance(status, RunStatus) and status.step == 3 and answers.asked == [StatusQuery()]


def test_a_request_before_the_handshake_is_refused_without_asking_the_controller(endpoint: Any) -> None:
    made, answers, peer = endpoint
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.linger = 0
    stranger.connect(made.config.controller.address)
    try:
        stranger.send_multipart([pack_request_id(1), encode_control(StatusQuery())])
        deadline = time.monotonic() + 10
        while not stranger.poll(5):
            assert time.monotonic() < deadline
            made.serve()
        refused = decode_control(stranger.recv_multipart()[1])
        assert isinstance(refused, ErrorReply) and refused.code == "handshake_required"
        assert answers.asked == []
    finally:
        stranger.close(0)


def test_unreadable_requests_are_answered_malformed_and_counted(endpoint: Any) -> None:
    made, answers, peer = endpoint
    trainer = peer()
    trainer.send_raw(pack_request_id(9), b"\xc1")  # not msgpack
    error = trainer.reply()
    assert isinstance(error, ErrorReply) and error.code == "malformed"
    trainer.send_raw(b"only one part")
    error = trainer.reply()
    assert isinstance(error, ErrorReply) and error.code == "malformed" and "needs >= 2" in error.message
    assert made.tally.counters == {"malformed_requests": 1}  # the short request is not a decode failure
    assert answers.asked == []


def test_an_error_in_answering_is_the_reply_and_the_endpoint_keeps_serving(endpoint: Any) -> None:
    made, answers, peer = endpoint
    trainer = peer()
    answers.fail = True
    trainer.ask(StatusQuery())
    error = trainer.reply()
    assert isinstance(error, ErrorReply) and error.code == "internal" and "RuntimeError" in error.message
    answers.fail = False
    trainer.ask(StatusQuery())
    assert isinstance(trainer.reply(), RunStatus)


def test_the_first_batch_request_is_answered_at_once_later_ones_are_held(endpoint: Any) -> None:
    made, answers, peer = endpoint
    trainer = peer()
    trainer.ask(BatchRequest(trainer_step=0))
    first = trainer.reply()  # the request that restores the run is never held
    assert isinstance(first, NoBatchYet) and first.retry_after_s == 0.02
    before = time.monotonic()  # no later than the hold starts: the hold is not over then
    trainer.ask(BatchRequest(trainer_step=0))
    wait_until(lambda: len(answers.asked) == 2, made.serve)
    made.answer_held(before)  # asked again: still no batch
    assert len(answers.asked) == 3 and not trainer.has_reply()
    answers.ready = True
    made.answer_held(before)
    assert isinstance(trainer.reply(), RunComplete)


def test_a_held_request_is_answered_no_batch_without_delay_once_its_hold_is_over(endpoint: Any) -> None:
    made, answers, peer = endpoint
    answers.restored = True
    trainer = peer()
    trainer.ask(BatchRequest(trainer_step=0))
    wait_until(lambda: answers.asked, made.serve)
    made.answer_held(time.monotonic() + 1.0)  # past BATCH_HOLD_S
    late = trainer.reply()
    assert isinstance(late, NoBatchYet) and late.reason == "scoring" and late.retry_after_s == 0.0


def test_a_newer_batch_request_supersedes_the_held_one(endpoint: Any) -> None:
    made, answers, peer = endpoint
    answers.restored = True
    old, new = peer(), peer()
    old.ask(BatchRequest(trainer_step=0))
    wait_until(lambda: answers.asked, made.serve)
    new.ask(BatchRequest(trainer_step=0))
    superseded = old.reply()
    assert isinstance(superseded, NoBatchYet) and superseded.reason == "superseded"
    answers.ready = True
    made.answer_held(0.0)  # with a batch ready, however long it was held
    assert isinstance(new.reply(), RunComplete)


def test_a_stopping_controller_answers_the_request_it_holds(endpoint: Any) -> None:
    """A run that stops while it holds the trainer's BatchRequest (its end, or a config error
    the dispatch found) answers it, instead of leaving the trainer to its whole timeout."""
    made, answers, peer = endpoint
    answers.restored = True
    trainer = peer()
    trainer.ask(BatchRequest(trainer_step=0))
    wait_until(lambda: answers.asked, made.serve)
    assert not trainer.has_reply()  # held
    made.close()
    wait_until(lambda: trainer.socket.poll(5), lambda: None)
    last = decode_control(trainer.socket.recv_multipart()[1])
    assert isinstance(last, NoBatchYet) and last.reason == "the controller is stopping"
