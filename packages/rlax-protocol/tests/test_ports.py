"""`reserve_port`: a planned server's port is free and outside the outgoing-connection range."""

from __future__ import annotations

import pathlib
import socket

import pytest

from rlax_protocol import ports


def test_a_reserved_port_is_free_and_below_the_ephemeral_range() -> None:
    span = ports.ephemeral_range()
    if span is None or span[0] - 10_000 < 1_000:
        pytest.fail(f"this test needs Linux's default ephemeral range (32768-60999), got {span}")
    chosen = {ports.reserve_port() for _ in range(20)}
    assert all(10_000 <= port < span[0] for port in chosen), chosen
    assert len(chosen) > 1  # drawn at random: two launches side by side do not pick alike
    for port in chosen:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nothing holds it


def test_a_port_something_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        free = ports.reserve_port()
        draws = iter([taken, taken, free])

        class Draws:
            @staticmethod
            def randrange(low: int, high: int) -> int:
                return next(draws)

        monkeypatch.setattr(ports, "_random", Draws())
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 20_000, 60_999))
        assert ports.reserve_port() == free


def test_without_room_below_the_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("10500\t60999\n")  # only 500 ports below: too few to draw from
    monkeypatch.setattr(ports, "_RANGE_FILE", narrow)
    assert ports.ephemeral_range() == (10_500, 60_999)
    port = ports.reserve_port()
    assert port >= 1024
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
