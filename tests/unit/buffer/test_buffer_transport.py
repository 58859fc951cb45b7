"""ZeroMQ transport over real sockets: ipc:// in tmp_path, tcp:// on loopback."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time

import pytest
import zmq
import zmq.asyncio
from buffer_factories import free_tcp_port_pair, make_group, producer_process_main

from buffer import protocol
from buffer.keys import CurveKeys, generate_curve_keys, load_curve_keys
from buffer.protocol import Ack, Announce, Heartbeat, Hello, Reply, Welcome
from buffer.schema import RolloutGroup, encode
from buffer.store import RolloutBuffer
from buffer.transport import (
    LearnerEndpoint,
    ProducerEndpoint,
    Receiver,
    check_bind_addr,
    derive_ctl_addr,
    derive_pub_addr,
)


def _ipc(tmp_path, name="rollouts") -> str:
    return f"ipc://{tmp_path}/{name}.sock"


def test_derive_ctl_addr():
    assert derive_ctl_addr("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5557"
    assert derive_ctl_addr("tcp://[::1]:7000") == "tcp://[::1]:7002"
    assert derive_ctl_addr("ipc:///tmp/x") == "ipc:///tmp/x.ctl"
    assert derive_ctl_addr("inproc://x") == "inproc://x.ctl"


async def serve_control(learner: LearnerEndpoint, seen: list) -> None:
    """A minimal learner control loop: records each request, welcomes a Hello, acks the rest."""
    while True:
        got = await learner.recv_control()
        if got is None:
            continue
        peer, rid, msg = got
        seen.append(msg)
        answer = Welcome(producer_id=msg.producer_id, incarnation=msg.incarnation,
                         learner_session="s") if isinstance(msg, Hello) else Reply(ok=True)
        await learner.reply(peer, rid, answer)


def test_derive_pub_addr():
    assert derive_pub_addr("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5556"
    assert derive_pub_addr("tcp://[::1]:7000") == "tcp://[::1]:7001"
    assert derive_pub_addr("ipc:///tmp/x") == "ipc:///tmp/x.pub"
    with pytest.raises(ValueError):
        derive_pub_addr("tcp://host")
    with pytest.raises(ValueError):
        derive_pub_addr("udp://h:1")


@pytest.mark.parametrize(
    "addr",
    ["tcp://127.0.0.1:5000", "tcp://127.1.2.3:5000", "tcp://localhost:5000", "tcp://[::1]:5000",
     "ipc:///tmp/x.sock", "inproc://x"],
)
def test_loopback_bind_always_allowed(addr):
    check_bind_addr(addr, None, insecure=False)


@pytest.mark.parametrize(
    "addr", ["tcp://0.0.0.0:5000", "tcp://*:5000", "tcp://10.1.2.3:5000", "tcp://eth0:5000",
             "tcp://example.com:5000"],
)
def test_exposed_bind_needs_curve_or_insecure(addr, caplog):
    with pytest.raises(ValueError, match="refusing to bind"):
        check_bind_addr(addr, None, insecure=False)
    with caplog.at_level(logging.WARNING, logger="buffer.transport"):
        check_bind_addr(addr, None, insecure=True)
    assert "without encryption" in caplog.text
    check_bind_addr(addr, CurveKeys(b"pub", b"secret"), insecure=False)
    with pytest.raises(ValueError, match="server secret"):
        check_bind_addr(addr, CurveKeys(b"pub", None), insecure=False)
    with pytest.raises(ValueError, match="refusing to bind"):
        LearnerEndpoint(addr)


def test_round_trip_receiver_and_announce(tmp_path):
    async def main():
        learner = LearnerEndpoint(_ipc(tmp_path))
        producer = ProducerEndpoint(_ipc(tmp_path))
        store = RolloutBuffer(capacity=16, max_staleness=None)
        control = []
        task = asyncio.create_task(Receiver(learner, store).run())
        server = asyncio.create_task(serve_control(learner, control))
        try:
            hello = Hello(producer_id="p0", incarnation="i", policy_version=0, pid=1)
            assert await producer.call(hello, 5) == Welcome(producer_id="p0", incarnation="i",
                                                            learner_session="s")
            for i in range(5):
                await producer.send(make_group(f"g{i}"))
            hb = Heartbeat(producer_id="p0", incarnation="i", policy_version=0,
                           stats={"tok_s": 1.0})
            assert await producer.call(hb, 5) == Reply(ok=True)
            ack = Ack(producer_id="p0", incarnation="i", version=1, ok=True)
            assert await producer.call(ack, 5) == Reply(ok=True)
            batch = await store.get_batch(5, learner_version=0, timeout=5)
            assert [g.group_id for g in batch] == [f"g{i}" for i in range(5)]
            assert batch[0] == make_group("g0")
            assert control == [hello, hb, ack]
            assert learner.frames_received == 8 and learner.rejected == 0
            assert learner.bytes_received > 0 and producer.frames_sent == 5
            # PUB/SUB: re-publish until the subscription has propagated (slow joiner).
            ann = Announce(version=1, snapshot_uri="file:///x", snapshot_checksum="sum",
                           learner_session="s", received={"p0": 5}, consumed={"p0": 5})
            got = None
            for _ in range(50):
                await learner.publish(ann)
                got = await producer.recv_announce(timeout=0.1)
                if got is not None:
                    break
            assert got == ann
            assert await producer.recv_announce(timeout=0.05) in (None, ann)
        finally:
            task.cancel()
            server.cancel()
            producer.close()
            learner.close()

    asyncio.run(main())


def test_call_times_out_without_a_learner_and_skips_stale_answers(tmp_path):
    async def main():
        producer = ProducerEndpoint(_ipc(tmp_path))
        hb = Heartbeat(producer_id="p0", incarnation="i", policy_version=0, stats={})
        try:
            t0 = time.monotonic()
            assert await producer.call(hb, 0.2) is None
            assert time.monotonic() - t0 < 30  # gave up at 0.2 s; no answer ever comes
            learner = LearnerEndpoint(_ipc(tmp_path))
            seen = []
            server = asyncio.create_task(serve_control(learner, seen))
            try:
                # The request queued while the learner was down is answered first (stale rid).
                assert await producer.call(hb, 5) == Reply(ok=True)
                assert len(seen) == 2
            finally:
                server.cancel()
                learner.close()
        finally:
            producer.close()

    asyncio.run(main())


def test_send_blocks_at_hwm_then_delivers_when_learner_starts(tmp_path):
    """Lossless while the learner is down: frames queue on the producer, send() waits
    (TimeoutError, never a drop), and everything arrives once the learner binds."""

    async def main():
        producer = ProducerEndpoint(_ipc(tmp_path), sndhwm=2)
        sent = 0
        with pytest.raises(TimeoutError, match="could not queue"):
            for i in range(50):
                await producer.send(make_group(f"g{i}"), timeout=0.2)
                sent += 1
        assert 1 <= sent < 50
        learner = LearnerEndpoint(_ipc(tmp_path), rcvhwm=2)
        try:
            await producer.send(make_group("after"), timeout=5)
            got = [await asyncio.wait_for(learner.recv(), 5) for _ in range(sent + 1)]
            assert [g.group_id for g in got] == [f"g{i}" for i in range(sent)] + ["after"]
        finally:
            producer.close()
            learner.close()

    asyncio.run(main())


def test_close_does_not_hang_with_unsent_frames(tmp_path):
    async def main():
        producer = ProducerEndpoint(_ipc(tmp_path, "nobody"), sndhwm=4)
        for i in range(3):
            await producer.send(make_group(f"g{i}"), timeout=1)
        t0 = time.monotonic()
        producer.close()
        assert time.monotonic() - t0 < 30  # unsent frames never block close

    asyncio.run(main())


def test_oversized_frame_is_refused_and_endpoint_survives(tmp_path):
    async def main():
        learner = LearnerEndpoint(_ipc(tmp_path), max_frame_bytes=4096)
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.connect(_ipc(tmp_path))
        producer = ProducerEndpoint(_ipc(tmp_path))
        try:
            await raw.send(encode(make_group("huge", n_tokens=4096)))
            await asyncio.sleep(0.1)
            await producer.send(make_group("small"))
            msg = await asyncio.wait_for(learner.recv(), 5)
            assert isinstance(msg, RolloutGroup) and msg.group_id == "small"
        finally:
            raw.close(linger=0)
            ctx.term()
            producer.close()
            learner.close()

    asyncio.run(main())


def test_curve_encryption_and_client_allow_list(tmp_path):
    keys = generate_curve_keys(tmp_path / "keys")
    assert generate_curve_keys(tmp_path / "keys") == keys  # second call reads, not rewrites
    port = free_tcp_port_pair()
    addr = f"tcp://127.0.0.1:{port}"

    async def main():
        learner = LearnerEndpoint(addr, curve=keys)
        good = ProducerEndpoint(addr, curve=keys)
        other_pub, other_sec = zmq.curve_keypair()
        bad = ProducerEndpoint(
            addr, curve=CurveKeys(keys.server_public, None, other_pub, other_sec)
        )
        try:
            await bad.send(make_group("intruder"), timeout=1)
            await good.send(make_group("friend"), timeout=5)
            msg = await asyncio.wait_for(learner.recv(), 5)
            assert msg.group_id == "friend"
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(learner.recv(), 0.5)
        finally:
            bad.close()
            good.close()
            learner.close()

    asyncio.run(main())



def test_a_producer_node_needs_only_the_public_server_key_and_the_client_pair(tmp_path):
    import shutil

    learner_keys = load_curve_keys(tmp_path / "learner", "learner")  # created on first use
    node = tmp_path / "node"
    node.mkdir()
    for name in ("server.key", "client.key", "client.key_secret"):
        shutil.copy(tmp_path / "learner" / name, node / name)
    keys = load_curve_keys(node, "producer")
    assert keys.server_secret is None and keys.server_public == learner_keys.server_public
    assert keys.client_secret == learner_keys.client_secret
    port = free_tcp_port_pair()

    async def main():
        learner = LearnerEndpoint(f"tcp://0.0.0.0:{port}", curve=learner_keys)  # not loopback
        producer = ProducerEndpoint(f"tcp://127.0.0.1:{port}", curve=keys)
        try:
            await producer.send(make_group("over-curve"), timeout=5)
            assert (await asyncio.wait_for(learner.recv(), 5)).group_id == "over-curve"
        finally:
            producer.close()
            learner.close()

    asyncio.run(main())

def test_three_producer_processes_into_slow_receiver():
    n_producers, n_groups = 3, 200
    port = free_tcp_port_pair()
    addr = f"tcp://127.0.0.1:{port}"

    async def main():
        learner = LearnerEndpoint(addr, rcvhwm=2)
        store = RolloutBuffer(capacity=4, max_staleness=None)
        hellos = []
        receiver = asyncio.create_task(Receiver(learner, store).run())
        server = asyncio.create_task(serve_control(learner, hellos))
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=producer_process_main, args=(addr, f"p{k}", n_groups, 2))
            for k in range(n_producers)
        ]
        for p in procs:
            p.start()
        seqs: dict[str, list[int]] = {f"p{k}": [] for k in range(n_producers)}
        try:
            total = n_producers * n_groups
            served = 0
            while served < total:
                batch = await store.get_batch(1, learner_version=0, timeout=60)
                await asyncio.sleep(0.0005)  # a deliberately slow learner
                for g in batch:
                    seqs[g.producer_id].append(g.metadata["seq"])
                    assert len(g.completions) == 2
                served += len(batch)
            ann = Announce(version=1, snapshot_uri="done", snapshot_checksum="",
                           learner_session="s", received={}, consumed={})
            deadline = time.monotonic() + 60
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                await learner.publish(ann)
                await asyncio.sleep(0.05)
        finally:
            receiver.cancel()
            server.cancel()
            learner.close()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        assert [p.exitcode for p in procs] == [0] * n_producers
        for pid, got in seqs.items():
            assert got == list(range(n_groups)), f"{pid} lost or reordered groups"
        s = store.stats
        assert (s.received, s.served, s.rejected, s.dropped_capacity, s.size) == (
            total, total, 0, 0, 0
        )
        assert sorted(h.producer_id for h in hellos) == ["p0", "p1", "p2"]

    asyncio.run(main())


def test_receiver_counts_rejected_frames_in_store(tmp_path):
    async def main():
        learner = LearnerEndpoint(_ipc(tmp_path))
        store = RolloutBuffer(capacity=4, max_staleness=None)
        task = asyncio.create_task(Receiver(learner, store).run())
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.connect(_ipc(tmp_path))
        try:
            await raw.send(b"\x81\xa1xgarbage")
            await raw.send(encode(make_group("ok")))
            batch = await store.get_batch(1, learner_version=0, timeout=5)
            assert batch[0].group_id == "ok"
            await raw.send(protocol.encode(Ack(producer_id="p0", incarnation="i", version=1,
                                               ok=False)))  # control on the data socket
            await raw.send(encode(make_group("ok2")))
            batch = await store.get_batch(1, learner_version=0, timeout=5)
            assert batch[0].group_id == "ok2"
            assert store.stats.rejected == 2 and learner.rejected == 2
            assert learner.last_reason == "not_a_group"
        finally:
            task.cancel()
            raw.close(linger=0)
            ctx.term()
            learner.close()

    asyncio.run(main())
