"""Streamed snapshots: weights for a producer on another machine, with no shared filesystem.

The learner's node runs a ``SnapshotServer`` (a ZeroMQ ROUTER, CurveZMQ-encrypted and limited
to the run's client key) that serves byte ranges of the snapshot files under its roots. A producer
elsewhere uses the stream route (``sync.routes.stream``): its ``stage`` (run by the barrier
*before* the pause) copies the announced file in chunks (``fetch_snapshot``) into a directory of
its own node, hashes the bytes as they arrive and refuses a copy whose checksum differs from the
announce, then stages that copy exactly as the file route does (the vLLM workers read it and check
checksum, names and shapes). So a torn or tampered stream never pauses the engine, and a load can
only fail the way a file load can.

Wire format (msgpack, no pickle): request ``{"path": str, "offset": int, "size": int}``; reply
``{"ok": True, "total": int, "data": bytes}`` or ``{"ok": False, "error": str}``. The client keeps
``window`` requests in flight to hide the round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgpack
import zmq
import zmq.asyncio

from sync.snapshot import SnapshotError, SnapshotRef, checksum_bytes

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
SNAPSHOT_FILE_NAME = re.compile(r"^policy_v\d+\.safetensors$")


@dataclass(frozen=True)
class StreamKeys:
    """CurveZMQ keys (Z85 bytes). The server needs its pair and the one client key it admits;
    a client needs the server's public key and its own pair."""

    server_public: bytes
    server_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None


class SnapshotServer:
    """Serves byte ranges of snapshot files (``policy_vN.safetensors`` directly under one of
    ``roots``) at ``addr`` from a daemon thread. Nothing else on the host is readable through it."""

    def __init__(self, addr: str, roots: list[str | Path], keys: StreamKeys | None):
        self.roots = [Path(r).resolve() for r in roots]
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            allowed = keys.client_public
            self._auth.configure_curve_callback(domain="*", credentials_provider=_Allow(allowed))
            self._sock.curve_secretkey = keys.server_secret
            self._sock.curve_publickey = keys.server_public
            self._sock.curve_server = True
        self._sock.bind(addr)
        self.addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bytes_served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="snapshot-server", daemon=True)
        self._thread.start()

    def _allowed(self, path: str) -> Path:
        p = Path(path).resolve()
        if not SNAPSHOT_FILE_NAME.match(p.name) or p.parent not in self.roots:
            raise PermissionError(f"{path} is not a snapshot file this server serves")
        return p

    def _answer(self, raw: bytes) -> dict[str, Any]:
        try:
            req = msgpack.unpackb(raw, raw=False)
            path, offset, size = req["path"], int(req["offset"]), int(req["size"])
            if not isinstance(path, str) or offset < 0 or not 0 < size <= 4 * CHUNK_BYTES:
                raise ValueError("bad request")
            p = self._allowed(path)
            with open(p, "rb") as fh:
                total = fh.seek(0, 2)
                fh.seek(offset)
                data = fh.read(size)
        except Exception as e:  # a bad request or a pruned file: the client reports it
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        self.bytes_served += len(data)
        return {"ok": True, "total": total, "data": data}

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                ident, _empty, raw = self._sock.recv_multipart()
            except ValueError:
                continue  # not a DEALER request frame set
            except zmq.ZMQError:
                break
            reply = msgpack.packb(self._answer(raw), use_bin_type=True)
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart([ident, b"", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class _Allow:
    def __init__(self, key: bytes | None):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return self.key is None or key == self.key


def _client_socket(ctx: zmq.asyncio.Context, addr: str, keys: StreamKeys | None) -> Any:
    """A DEALER connected to the server at ``addr`` (CurveZMQ with ``keys``)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    sock.connect(addr)
    return sock


def _check_copy(ref: SnapshotRef, addr: str, tmp: Path, received: int, total: int | None,
                hashed: str | None) -> None:
    """Refuse a streamed copy that is short or whose checksum differs from the announce's
    (``hashed``: the checksum computed while it arrived, if its algorithm allows)."""
    if total is None or received != total:
        raise SnapshotError(
            f"snapshot v{ref.version}: stream from {addr} ended at {received} of {total} bytes"
        )
    algo = ref.checksum.partition(":")[0]
    got = hashed if hashed is not None else checksum_bytes(tmp.read_bytes(), algo)
    if got != ref.checksum:
        raise SnapshotError(
            f"snapshot v{ref.version}: streamed copy has checksum {got}, "
            f"the announce says {ref.checksum}; refusing to load"
        )


async def fetch_snapshot(
    addr: str,
    ref: SnapshotRef,
    dest: Path,
    keys: StreamKeys | None,
    *,
    chunk: int = CHUNK_BYTES,
    window: int = 4,
    timeout_s: float = 30.0,
    ctx: zmq.asyncio.Context | None = None,
) -> tuple[SnapshotRef, int]:
    """Copy ``ref``'s file from the server at ``addr`` to ``dest`` (atomic rename) and check it
    against ``ref.checksum``; returns the local ref and the byte count. ``timeout_s`` bounds the
    wait for each reply."""
    sock = _client_socket(ctx or zmq.asyncio.Context.instance(), addr, keys)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    algo = ref.checksum.partition(":")[0]
    h = blake3.blake3(max_threads=blake3.blake3.AUTO) if algo == "blake3" else None
    total: int | None = None
    received = 0
    try:
        with open(tmp, "wb") as fh:
            next_off = 0
            pending = 0

            async def ask() -> None:
                nonlocal next_off, pending
                req = {"path": ref.uri, "offset": next_off, "size": chunk}
                # Bounded too: a DEALER whose only connection failed (a CURVE handshake with
                # the wrong keys) has no peer, and its send would wait for one for ever.
                try:
                    await asyncio.wait_for(
                        sock.send_multipart([b"", msgpack.packb(req, use_bin_type=True)]),
                        timeout_s,
                    )
                except TimeoutError:
                    raise SnapshotError(
                        f"snapshot v{ref.version}: no reply from {addr} within {timeout_s:.0f}s "
                        f"(no connection to send the request on)"
                    ) from None
                next_off += chunk
                pending += 1

            await ask()
            while pending:
                if not await sock.poll(timeout_s * 1000):
                    raise SnapshotError(
                        f"snapshot v{ref.version}: no reply from {addr} within "
                        f"{timeout_s:.0f}s ({received} bytes received)"
                    )
                _empty, raw = await sock.recv_multipart()
                pending -= 1
                rep = msgpack.unpackb(raw, raw=False)
                if not rep.get("ok"):
                    raise SnapshotError(
                        f"snapshot v{ref.version}: {addr} refused {ref.uri}: {rep.get('error')}"
                    )
                total = int(rep["total"])
                data = rep["data"]
                fh.write(data)  # replies come in request order: one DEALER, one server thread
                if h is not None:
                    h.update(data)
                received += len(data)
                while pending < window and next_off < total:
                    await ask()
        _check_copy(ref, addr, tmp, received, total,
                    "blake3:" + h.hexdigest(16) if h is not None else None)
        tmp.replace(dest)
    finally:
        sock.close(0)
        tmp.unlink(missing_ok=True)
    return SnapshotRef(ref.version, str(dest), ref.checksum), received
