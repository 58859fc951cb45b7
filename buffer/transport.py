"""ZeroMQ transport between producers and the learner (zmq.asyncio).

Owns the sockets, their options, the bind-address security check and the receive loop that
feeds the RolloutBuffer. Topology: the learner binds, producers connect.

    producer PUSH   ──────────────(groups)──────────────► learner PULL    at addr       data
    producer DEALER ──(Hello, Heartbeat, Ack, SyncReady)─► learner ROUTER  at ctl_addr   control
                    ◄──────────(Welcome, Reply)──────────
    producer SUB    ◄─────────────(Announce)────────────── learner PUB     at pub_addr

Invariants:
- Control never waits behind data: the learner reads the ROUTER in its own loop, whatever the
  buffer's back-pressure does to the PULL socket. Groups travel in ``buffer.schema`` frames,
  everything else in ``buffer.protocol`` frames; each socket refuses the other kind.
- Nothing is dropped silently. Producers never drop on a full queue: ``send`` awaits (HWM
  back-pressure). Frames that fail to decode are counted (``rejected``) and the reason kept.
- Receiving sockets cap frames at ``max_frame_bytes`` (ZMQ_MAXMSGSIZE), so an oversized frame is
  refused by libzmq before it is ever buffered. (libzmq drops that connection; the peer
  reconnects.)
- Reconnection after either side restarts is ZMQ's own (reconnect interval ~100 ms). PUSH keeps
  ``IMMEDIATE=0`` on purpose: while the learner is down, frames queue on the producer (up to
  SNDHWM, then ``send`` waits) and flow once it is back, instead of failing.
- ``close`` never hangs: LINGER is bounded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from buffer import protocol
from buffer.keys import CurveKeys
from buffer.protocol import MAX_CONTROL_BYTES, Announce, ControlMessage, ProtocolError
from buffer.schema import DecodeError, RolloutGroup, decode, encode
from buffer.store import RolloutBuffer

log = logging.getLogger(__name__)

LINGER_MS = 1000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000


def derive_pub_addr(addr: str) -> str:
    """Announce (PUB) address next to the rollout (PULL) address: tcp://h:p -> tcp://h:(p+1),
    ipc://x -> ipc://x.pub, inproc://x -> inproc://x.pub."""
    if addr.startswith("tcp://"):
        host, sep, port = addr[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"cannot derive a PUB address from {addr!r}: need tcp://host:port")
        return f"tcp://{host}:{int(port) + 1}"
    if addr.startswith(("ipc://", "inproc://")):
        return addr + ".pub"
    raise ValueError(f"unsupported ZeroMQ address {addr!r} (use tcp://, ipc:// or inproc://)")


def derive_ctl_addr(addr: str) -> str:
    """Control (ROUTER) address next to the rollout (PULL) address: tcp://h:p -> tcp://h:(p+2),
    ipc://x -> ipc://x.ctl, inproc://x -> inproc://x.ctl."""
    if addr.startswith("tcp://"):
        host, _, port = derive_pub_addr(addr)[len("tcp://") :].rpartition(":")
        return f"tcp://{host}:{int(port) + 1}"
    return derive_pub_addr(addr)[: -len(".pub")] + ".ctl"


def _is_loopback(addr: str) -> bool:
    if addr.startswith(("ipc://", "inproc://")):
        return True
    if not addr.startswith("tcp://"):
        return False
    host = urlsplit(addr).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name, a DNS name or '*': reachable from elsewhere


def check_bind_addr(addr: str, curve: CurveKeys | None, insecure: bool) -> None:
    """Refuse to expose an unauthenticated endpoint beyond this host.

    Loopback addresses (127.0.0.0/8, localhost, ::1, ipc://, inproc://) are always fine. Any
    other address needs CurveZMQ keys, or ``insecure=True`` (logged as a warning).
    """
    if _is_loopback(addr):
        return
    if curve is not None:
        if curve.server_secret is None:
            raise ValueError(f"binding {addr!r} with CURVE needs the server secret key")
        return
    if insecure:
        log.warning(
            "binding %s without encryption or authentication (insecure=True): anyone who can "
            "reach this address can inject rollouts",
            addr,
        )
        return
    raise ValueError(
        f"refusing to bind {addr!r}: it is reachable from other hosts and no CURVE keys were "
        "given. Bind to 127.0.0.1 / ipc://, pass CurveKeys (see generate_curve_keys), or set "
        "insecure=True on a trusted network."
    )


def _common_opts(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)


class _KeyAllowList:
    """ZAP credentials provider: admit only the configured client public key."""

    def __init__(self, allowed: bytes):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed  # pyzmq passes the Z85-encoded client key


class LearnerEndpoint:
    """Learner side: PULL (bound at addr) for groups, ROUTER (ctl_addr) for control messages,
    PUB (pub_addr) for announcements."""

    def __init__(
        self,
        addr: str,
        *,
        pub_addr: str | None = None,
        ctl_addr: str | None = None,
        max_frame_bytes: int = 64 << 20,
        rcvhwm: int = 64,
        curve: CurveKeys | None = None,
        insecure: bool = False,
        ctx: zmq.asyncio.Context | None = None,
    ):
        self.addr = addr
        self.pub_addr = pub_addr or derive_pub_addr(addr)
        self.ctl_addr = ctl_addr or derive_ctl_addr(addr)
        for a in (addr, self.pub_addr, self.ctl_addr):
            check_bind_addr(a, curve, insecure)
        self.max_frame_bytes = max_frame_bytes
        self.frames_received = 0
        self.rejected = 0
        self.bytes_received = 0
        self.last_error: str | None = None
        self.last_reason = ""
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._auth = None
        self._pull = self._ctx.socket(zmq.PULL)
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        try:
            if curve is not None and curve.client_public is not None:
                from zmq.auth.thread import ThreadAuthenticator

                # ZAP must live in the same libzmq context; a sync shadow keeps the
                # authenticator thread off the event loop.
                self._auth = ThreadAuthenticator(zmq.Context.shadow(self._ctx.underlying))
                self._auth.start()
                self._auth.configure_curve_callback(
                    domain="*", credentials_provider=_KeyAllowList(curve.client_public)
                )
            for sock in (self._pull, self._pub, self._router):
                _common_opts(sock)
                if curve is not None:
                    sock.curve_secretkey = curve.server_secret
                    sock.curve_publickey = curve.server_public
                    sock.curve_server = True
            self._pull.setsockopt(zmq.RCVHWM, rcvhwm)
            self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            self._router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
            self._pull.bind(addr)
            self._pub.bind(self.pub_addr)
            self._router.bind(self.ctl_addr)
        except BaseException:
            self.close()
            raise

    async def recv(self) -> RolloutGroup | None:
        """Next group, or None if the frame was not a valid group (counted in ``rejected``; the
        reason in ``last_error`` and its kind in ``last_reason``). Never raises DecodeError."""
        frame = await self._pull.recv(copy=True)
        self.frames_received += 1
        self.bytes_received += len(frame)
        try:
            return decode(frame, self.max_frame_bytes)
        except DecodeError as e:
            self.rejected += 1
            self.last_error = str(e)
            self.last_reason = e.reason
            log.debug("rejected frame %d: %s", self.frames_received, e)
            return None

    async def recv_control(self) -> tuple[bytes, int, ControlMessage] | None:
        """Next control request as (peer, rid, message), for :meth:`reply`; None if the frame
        was invalid (counted in ``rejected``, like data frames)."""
        parts = await self._router.recv_multipart(copy=True)
        self.frames_received += 1
        try:
            if len(parts) != 2:
                raise ProtocolError(f"expected one frame per request, got {len(parts) - 1}")
            rid, msg = protocol.decode(parts[1])
            if not isinstance(msg, ControlMessage):
                raise ProtocolError(f"a {type(msg).__name__} is not a producer's request")
        except ProtocolError as e:
            self.rejected += 1
            self.last_error = str(e)
            self.last_reason = "malformed_control"
            log.debug("rejected control frame: %s", e)
            return None
        return parts[0], rid, msg

    async def reply(self, peer: bytes, rid: int, msg: protocol.Message) -> None:
        """Answer request ``rid`` of ``peer``. Never blocks: a peer gone or not reading loses
        its answer (ROUTER drops), and the learner goes on."""
        await self._router.send_multipart([peer, protocol.encode(msg, rid)])

    async def publish(self, msg: Announce) -> None:
        """Broadcast an announcement to every connected producer. PUB drops for subscribers
        that are not connected yet (slow joiners); callers re-publish the latest Announce."""
        await self._pub.send(protocol.encode(msg))

    def close(self) -> None:
        for sock in (self._pull, self._pub, self._router):
            sock.close(linger=LINGER_MS)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()


class ProducerEndpoint:
    """Producer side: PUSH to the learner's PULL, DEALER to its ROUTER, SUB to its PUB."""

    def __init__(
        self,
        addr: str,
        *,
        pub_addr: str | None = None,
        ctl_addr: str | None = None,
        sndhwm: int = 16,
        max_frame_bytes: int = 64 << 20,
        curve: CurveKeys | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ):
        self.addr = addr
        self.pub_addr = pub_addr or derive_pub_addr(addr)
        self.ctl_addr = ctl_addr or derive_ctl_addr(addr)
        self.max_frame_bytes = max_frame_bytes
        self.frames_sent = 0
        self.bytes_sent = 0
        self.rejected = 0
        self.last_error: str | None = None
        self._rid = 0
        self._call_lock = asyncio.Lock()
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer = self._ctx.socket(zmq.DEALER)
        try:
            for sock in (self._push, self._sub, self._dealer):
                _common_opts(sock)
                if curve is not None:
                    if curve.client_secret is None or curve.client_public is None:
                        raise ValueError("a CURVE producer needs client_public and client_secret")
                    sock.curve_serverkey = curve.server_public
                    sock.curve_publickey = curve.client_public
                    sock.curve_secretkey = curve.client_secret
            self._push.setsockopt(zmq.SNDHWM, sndhwm)
            # Queue while the learner is down or restarting (lossless), rather than refusing.
            self._push.setsockopt(zmq.IMMEDIATE, 0)
            self._sub.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
            self._push.connect(addr)
            self._sub.connect(self.pub_addr)
            self._dealer.connect(self.ctl_addr)
        except BaseException:
            self.close()
            raise

    async def send(self, group: RolloutGroup, timeout: float | None = None) -> None:
        """Send one group; waits while the queue is at its high-water mark (never drops).
        Raises TimeoutError if it could not be queued within ``timeout`` seconds."""
        frame = encode(group)
        if timeout is None:
            await self._push.send(frame)
        else:
            try:
                await asyncio.wait_for(self._push.send(frame), timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"ProducerEndpoint.send: could not queue a group to {self.addr} within "
                    f"{timeout:.3g} s (learner down, or not consuming)"
                ) from None
        self.frames_sent += 1
        self.bytes_sent += len(frame)

    async def call(self, msg: ControlMessage, timeout: float) -> protocol.Message | None:
        """Send ``msg`` on the control channel and return the learner's answer (a Welcome to a
        Hello, else a Reply), or None if none came within ``timeout`` seconds. One call at a
        time; answers to earlier calls that timed out are skipped."""
        async with self._call_lock:
            self._rid += 1
            rid = self._rid
            deadline = time.monotonic() + timeout
            try:
                await asyncio.wait_for(self._dealer.send(protocol.encode(msg, rid)), timeout)
            except TimeoutError:
                return None
            while True:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not await self._dealer.poll(wait_ms, zmq.POLLIN):
                    return None
                frame = await self._dealer.recv()
                try:
                    got, answer = protocol.decode(frame)
                except ProtocolError as e:
                    self.rejected += 1
                    self.last_error = str(e)
                    continue
                if got == rid:
                    return answer

    async def recv_announce(self, timeout: float | None) -> Announce | None:
        """Next Announce from the learner, or None after ``timeout`` seconds. Malformed frames
        (and non-Announce messages) are counted in ``rejected`` and skipped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is None:
                wait_ms = None
            else:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not await self._sub.poll(wait_ms, zmq.POLLIN):
                return None
            frame = await self._sub.recv()
            try:
                _, msg = protocol.decode(frame, self.max_frame_bytes)
                if not isinstance(msg, Announce):
                    raise ProtocolError(f"expected an Announce, got {type(msg).__name__}")
                return msg
            except ProtocolError as e:
                self.rejected += 1
                self.last_error = str(e)
                log.debug("skipped invalid announce frame: %s", e)

    def close(self) -> None:
        for sock in (self._push, self._sub, self._dealer):
            sock.close(linger=LINGER_MS)
        if self._own_ctx:
            self._ctx.term()


class Receiver:
    """Pumps LearnerEndpoint's data socket -> RolloutBuffer (benchmarks and tests; the learner
    adds its producer checks, ``pipeline.learner``).

    Back-pressure: it waits for space in the buffer before reading the next frame, so a full
    buffer fills the socket queues and finally blocks producers' ``send``; nothing is dropped.
    Control messages do not pass here: they have their own socket.
    """

    def __init__(self, endpoint: LearnerEndpoint, store: RolloutBuffer):
        self.endpoint = endpoint
        self.store = store

    async def run(self) -> None:
        while True:
            await self.store.wait_for_space()
            group = await self.endpoint.recv()
            if group is None:
                self.store.note_rejected()
            else:
                self.store.put(group)
