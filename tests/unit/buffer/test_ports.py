"""Free ports are chosen below the ephemeral range, where no outgoing connection can take them
between the choice and the bind (nor a producer connect to itself before its learner binds)."""

from __future__ import annotations

import socket

import pytest

from buffer import ports


def test_ports_lie_below_the_ephemeral_range_and_bind():
    low, _ = ports.ephemeral_range()
    chosen = ports.free_ports("127.0.0.1", 6)
    assert len(set(chosen)) == 6
    assert all(10000 <= p < low for p in chosen)
    for p in chosen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_pair_is_three_consecutive_free_ports():
    p = ports.free_tcp_port_pair()
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        a.bind(("127.0.0.1", p))
        b.bind(("127.0.0.1", p + 1))
        c.bind(("127.0.0.1", p + 2))


def test_a_port_taken_now_is_never_chosen(monkeypatch):
    """Only two candidate ports, one held: the other comes back every time."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_LOWEST", taken)
        monkeypatch.setattr(ports, "_ROOM", 2)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 2, 65535))
        monkeypatch.setattr(ports, "_os_ports", lambda *a: pytest.fail("fell back"))
        assert {ports.free_port() for _ in range(5)} == {taken + 1}


def test_a_range_that_leaves_no_room_below_falls_back_to_the_os(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    assert len(set(ports.free_ports("127.0.0.1", 3))) == 3
    p = ports.free_tcp_port_pair()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", p + 1))
        b.bind(("127.0.0.1", p + 2))
