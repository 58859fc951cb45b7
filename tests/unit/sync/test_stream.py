"""Streamed snapshots over real ZeroMQ (tcp on loopback, CurveZMQ): a copy checked against the
announce's checksum, refusals for files outside the server's roots, tampered checksums and
clients without the run's key, and the transport staging the local copy."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import zmq

from sync.routes.stream import StreamRoute
from sync.snapshot import SnapshotError, SnapshotRef, read_snapshot, write_snapshot
from sync.stream import SnapshotServer, StreamKeys, fetch_snapshot


def _keys() -> tuple[StreamKeys, StreamKeys]:
    sp, ss = zmq.curve_keypair()
    cp, cs = zmq.curve_keypair()
    return StreamKeys(sp, ss, cp, None), StreamKeys(sp, None, cp, cs)


@pytest.fixture
def served(tmp_path):
    src = tmp_path / "learner"
    tensors = {"w": torch.arange(3_000_000, dtype=torch.float32), "b": torch.ones(7)}
    ref = write_snapshot(tensors, 3, src)
    server_keys, client_keys = _keys()
    server = SnapshotServer("tcp://127.0.0.1:*", [src], server_keys)
    yield server, ref, client_keys, tensors
    server.close()


def test_fetch_copies_and_checks(served, tmp_path):
    server, ref, keys, tensors = served
    dest = tmp_path / "node2" / "policy_v3.safetensors"
    # Small chunks and a window: many requests in flight, reassembled in order.
    got, n = asyncio.run(fetch_snapshot(server.addr, ref, dest, keys, chunk=1 << 20, window=3))
    assert got.uri == str(dest) and got.checksum == ref.checksum
    assert n == os.path.getsize(ref.uri) == server.bytes_served
    loaded = read_snapshot(got)
    assert torch.equal(loaded["w"], tensors["w"]) and torch.equal(loaded["b"], tensors["b"])


def test_tampered_checksum_is_refused_and_leaves_nothing(served, tmp_path):
    server, ref, keys, _ = served
    bad = SnapshotRef(ref.version, ref.uri, "blake3:" + "0" * 32)
    dest = tmp_path / "node2" / "policy_v3.safetensors"
    with pytest.raises(SnapshotError, match="checksum"):
        asyncio.run(fetch_snapshot(server.addr, bad, dest, keys))
    assert list(dest.parent.iterdir()) == []


def test_only_snapshot_files_under_the_roots_are_served(served, tmp_path):
    server, ref, keys, _ = served
    secret = tmp_path / "policy_v3.safetensors"  # right name, wrong directory
    secret.write_bytes(b"x" * 100)
    for uri in (str(secret), "/etc/passwd", ref.uri + "/../../policy_v3.safetensors"):
        with pytest.raises(SnapshotError, match="refused"):
            asyncio.run(
                fetch_snapshot(
                    server.addr,
                    SnapshotRef(3, uri, ref.checksum),
                    tmp_path / "out" / "policy_v3.safetensors",
                    keys,
                )
            )


def test_client_without_the_run_key_gets_nothing(served, tmp_path):
    server, ref, keys, _ = served
    op, osec = zmq.curve_keypair()
    stranger = StreamKeys(keys.server_public, None, op, osec)
    with pytest.raises(SnapshotError, match="no reply"):
        asyncio.run(
            fetch_snapshot(
                server.addr, ref, tmp_path / "o" / "policy_v3.safetensors", stranger, timeout_s=1.0
            )
        )
    assert server.bytes_served == 0


class FakeEngine:
    """Records collective_rpc calls (the vLLM worker extension is exercised in tests/e2e)."""

    def __init__(self):
        self.calls = []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        return [{"read_s": 0.0}]


def test_transport_stages_the_local_copy_and_keeps_two(served, tmp_path):
    server, ref, keys, tensors = served
    engine = FakeEngine()
    local = tmp_path / "node2-stream"
    tr = StreamRoute(engine, server.addr, keys, local, keep=2)
    src = os.path.dirname(ref.uri)
    refs = [ref] + [write_snapshot(tensors, v, src) for v in (4, 5)]
    for r in refs:
        timings = asyncio.run(tr.stage(r))
        assert timings["stream_bytes"] > 0
    method, args = engine.calls[-1]
    assert method == "sync_stage_snapshot" and args[0] == 5
    assert args[1] == str(local / "policy_v5.safetensors") and args[2] == refs[-1].checksum
    assert sorted(p.name for p in local.iterdir()) == [
        "policy_v4.safetensors",
        "policy_v5.safetensors",
    ]
    assert tr.fetches == 3
    tr.close()
    assert not local.exists()
