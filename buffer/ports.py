"""Free TCP ports, chosen below the kernel's ephemeral range.

``bind(("", 0))`` hands out a port from the ephemeral range, the range the kernel also draws from
for every outgoing connection. A port chosen that way and bound later (a learner started after its
producers, ``accelerate``'s rendezvous, Ray's components) can be taken in between by any process's
connection, and a producer that connects to it before the learner binds may connect to itself.
A port below that range is taken only by an explicit bind, so these helpers pick there, check that
the port binds now, and fall back to the OS's choice only where the range leaves no room below it.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below it sit the well-known and commonly configured service ports
_ROOM = 1000  # fewer candidate ports than this below the range: the OS chooses
_TRIES = 500


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(host: str = "127.0.0.1", n: int = 1, *, consecutive: bool = False) -> list[int]:
    """``n`` distinct ports that bind on ``host`` now, all held open together while chosen (one
    at a time the same port could come back twice); ``consecutive`` makes them P, P+1, ...."""
    low, _ = ephemeral_range()
    if low - _LOWEST < _ROOM:
        return _os_ports(host, n, consecutive)
    pick = random.SystemRandom()
    with contextlib.ExitStack() as held:
        chosen: list[int] = []
        for _ in range(_TRIES):
            if len(chosen) == n:
                return chosen
            if consecutive:
                start = pick.randrange(_LOWEST, low - n)
                want = list(range(start, start + n))
            else:
                want = [pick.randrange(_LOWEST, low)]
            socks = _bind_all(host, [p for p in want if p not in chosen])
            if socks is None or (consecutive and len(socks) < n):
                continue
            for s in socks:
                held.enter_context(s)
            chosen = want if consecutive else [*chosen, *want]
        if len(chosen) == n:
            return chosen
    raise RuntimeError(f"no {n} free TCP ports on {host} below {low}")


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on ``host`` now."""
    return free_ports(host, 1)[0]


def free_tcp_port_pair(host: str = "127.0.0.1") -> int:
    """A free TCP port P on ``host`` with P+1 and P+2 free too: ``tcp://host:P`` for the
    learner's PULL socket and, by ``derive_pub_addr`` / ``derive_ctl_addr``, P+1 for its PUB
    and P+2 for its ROUTER socket."""
    return free_ports(host, 3, consecutive=True)[0]


def _bind_all(host: str, ports: list[int]) -> list[socket.socket] | None:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
    except OSError:
        for s in socks:
            s.close()
        return None
    return socks


def _os_ports(host: str, n: int, consecutive: bool) -> list[int]:
    """The OS's choice, for a host whose ephemeral range leaves no room below it."""
    if not consecutive:
        with contextlib.ExitStack() as held:
            socks = [held.enter_context(socket.socket()) for _ in range(n)]
            for s in socks:
                s.bind((host, 0))
            return [s.getsockname()[1] for s in socks]
    for _ in range(_TRIES):
        with socket.socket() as first:
            first.bind((host, 0))
            start = first.getsockname()[1]
            fits = start + n <= 65536
            rest = _bind_all(host, list(range(start + 1, start + n))) if fits else None
            if rest is not None:
                for s in rest:
                    s.close()
                return list(range(start, start + n))
    raise RuntimeError(f"no {n} consecutive free TCP ports on {host}")
