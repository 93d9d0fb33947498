"""The run's address book: where each server listens now, and the clients that read it
before each (re)connect."""

from __future__ import annotations

import pathlib
import threading

import pytest
import zmq

from rlax_core.addresses import AddressBook, resolver, write_address_book
from rlax_protocol.control_messages import RunStatus, StatusQuery, decode_control, encode_control
from rlax_protocol.errors import ProtocolTimeoutError
from rlax_protocol.messages import Hello
from rlax_protocol.request_links import ControlClient
from rlax_protocol.transport import welcome_for


def test_the_book_names_the_latest_addresses(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "addresses.json"
    book = AddressBook(path)
    assert book.lookup("paramserver", "tcp://a:1") == "tcp://a:1"  # no book yet: the config's
    write_address_book(path, {"paramserver": "tcp://b:2"})
    assert book.lookup("paramserver", "tcp://a:1") == "tcp://b:2"
    assert book.lookup("worker0", "tcp://w:3") == "tcp://w:3"  # not named: the config's
    write_address_book(path, {"paramserver": "tcp://c:3", "worker0": "tcp://w:4"})
    assert book.entries() == {"paramserver": "tcp://c:3", "worker0": "tcp://w:4"}
    assert not [p for p in tmp_path.iterdir() if p.name != "addresses.json"]  # no temp file left


def test_a_damaged_book_is_an_error_naming_it(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "addresses.json"
    path.write_text('{"paramserver": ')
    with pytest.raises(ValueError, match=f"address book {path}: not JSON"):
        AddressBook(path).lookup("paramserver", "x")
    path.write_text('{"paramserver": 5}')
    with pytest.raises(ValueError, match="must map process names to addresses"):
        AddressBook(path).lookup("paramserver", "x")


def test_no_book_in_the_config_means_fixed_addresses() -> None:
    assert resolver("", "controller", "tcp://127.0.0.1:1") is None


def _free_address() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_a_control_client_connects_where_the_book_says(tmp_path: pathlib.Path) -> None:
    """The trainer's controller client: the configured address is dead (the controller
    moved); the book comes to name the new one, which the client then connects to."""
    old, new = _free_address(), _free_address()
    path = tmp_path / "addresses.json"
    write_address_book(path, {"controller": old})
    stop = threading.Event()
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(new)

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            identity, request_id, body = router.recv_multipart()
            message = decode_control(body)
            reply = (
                welcome_for(message, server_id="moved")
                if isinstance(message, Hello)
                else RunStatus(step=7, total_steps=9, workers_alive=1, counters={}, finished=False)
            )
            router.send_multipart([identity, request_id, encode_control(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ControlClient(
        old,
        encode=encode_control,
        decode=decode_control,
        timeout_s=60.0,
        resolve=resolver(path, "controller", old),
    )
    moving = threading.Timer(0.5, write_address_book, args=(path, {"controller": new}))
    try:
        moving.start()
        # Nothing listens at the old address: the wait ends when the book names the new one,
        # not after the 60 s timeout; the next call connects there.
        with pytest.raises(ProtocolTimeoutError, match=f"the controller moved to {new}"):
            client.call(StatusQuery())
        reply = client.call(StatusQuery())
        assert isinstance(reply, RunStatus) and reply.step == 7
        assert client.peer == f"controller {new}"
    finally:
        moving.cancel()
        client.close()
        stop.set()
        thread.join(timeout=5)
        router.close(linger=0)
