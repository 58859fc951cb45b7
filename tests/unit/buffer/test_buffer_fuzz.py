"""Fuzzing: random and mutated frames to both decoders (groups: buffer.schema, control messages:
buffer.protocol) and to a live LearnerEndpoint's data and control sockets."""

from __future__ import annotations

import asyncio
import random

import msgpack
import zmq
import zmq.asyncio
from buffer_factories import make_group

from buffer import protocol
from buffer.protocol import Ack, Announce, Heartbeat, Hello, ProtocolError, SyncReady
from buffer.schema import DecodeError, RolloutGroup, decode, encode
from buffer.transport import LearnerEndpoint

CONTROL_SEEDS = [
    protocol.encode(Hello(producer_id="p", incarnation="i", policy_version=1, pid=2,
                          devices=["GPU-1"])),
    protocol.encode(Heartbeat(producer_id="p", incarnation="i", policy_version=1,
                              stats={"a": 1.0})),
    protocol.encode(Announce(version=3, snapshot_uri="uri", snapshot_checksum="sum",
                             learner_session="sess", received={"p": 1}, consumed={"p": 1},
                             transfer={"x": [1, b"z", {"y": None}]})),
    protocol.encode(Ack(producer_id="p", incarnation="i", version=3, ok=False, error="boom",
                        timings={"t": 1.0})),
    protocol.encode(SyncReady(producer_id="p", incarnation="i", purpose="weights", epoch=1,
                              version=2), rid=9),
]
SEEDS = [encode(make_group("seed", n_completions=3, n_tokens=12)), *CONTROL_SEEDS]


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    kind = rng.randrange(6)
    if kind == 0:  # bit flips
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncation
        b = b[: rng.randrange(len(b))]
    elif kind == 2:  # extension
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 3:  # byte overwrite with msgpack type markers
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.choice([0xC0, 0xC1, 0xC7, 0xD4, 0xDC, 0xDE, 0xFF, 0x7F])
    elif kind == 4:  # splice two frames
        other = rng.choice(SEEDS)
        cut = rng.randrange(len(b))
        b = b[:cut] + other[rng.randrange(len(other)) :]
    else:  # pure random bytes
        b = bytearray(rng.randbytes(rng.randint(0, 200)))
    return bytes(b)


def _random_msgpack(rng: random.Random, depth: int = 0):
    choices = [None, True, 1, -5, 2**40, 1.5, float("nan"), "s", b"\x00\x01", "kind"]
    if depth < 3:
        choices += ["list", "map"]
    c = rng.choice(choices)
    if c == "list":
        return [_random_msgpack(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if c == "map":
        keys = ["schema", "kind", "body", "group_id", "completions", "token_ids", "x",
                "protocol", "rid", "msg", "producer_id", "incarnation", "transfer"]
        return {rng.choice(keys): _random_msgpack(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return c


def _fuzz_frames(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    frames = []
    for i in range(n):
        if i % 10 == 4:
            obj = {"schema": 1, "kind": rng.choice(["group", "hello", "ack", "announce"]),
                   "body": _random_msgpack(rng)}
            frames.append(msgpack.packb(obj if rng.random() < 0.7 else _random_msgpack(rng)))
        elif i % 10 == 9:
            body = _random_msgpack(rng)
            if isinstance(body, dict) and rng.random() < 0.8:
                body["kind"] = rng.choice(["hello", "heartbeat", "ack", "sync_ready", "announce"])
            frames.append(msgpack.packb({"protocol": 1, "rid": rng.randrange(4), "msg": body}))
        else:
            frames.append(_mutate(rng, rng.choice(SEEDS)))
    return frames


def _classify(frame: bytes) -> bool:
    """True if decode() accepts the frame as a group; any other exception than DecodeError
    fails."""
    try:
        decode(frame)
        return True
    except DecodeError as e:
        assert str(e), "DecodeError without a message"
        return False


def _classify_control(frame: bytes) -> bool:
    """True if protocol.decode() accepts the frame; any other exception than ProtocolError
    fails."""
    try:
        protocol.decode(frame)
        return True
    except ProtocolError as e:
        assert str(e), "ProtocolError without a message"
        return False


def test_decode_fuzz_only_raises_decode_error():
    frames = _fuzz_frames(20_000, seed=1)
    groups = sum(_classify(f) for f in frames)
    control = sum(_classify_control(f) for f in frames)
    assert groups + control < len(frames) // 2  # the mutations are mostly destructive
    assert control > 0  # some mutations leave a valid message (e.g. a flipped digit)
    assert _classify(SEEDS[0]) and not _classify_control(SEEDS[0])
    for f in CONTROL_SEEDS:
        assert _classify_control(f) and not _classify(f)


def test_live_endpoint_counts_every_bad_frame_and_keeps_working(tmp_path):
    addr = f"ipc://{tmp_path}/fuzz.sock"
    frames = _fuzz_frames(5000, seed=2)
    expected_ok = [_classify(f) for f in frames]
    final = make_group("final-valid")

    async def main():
        learner = LearnerEndpoint(addr, rcvhwm=16)
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)

        async def send_all():
            for f in frames:
                await push.send(f)
            await push.send(encode(final))

        sender = asyncio.create_task(send_all())
        try:
            got = []
            for _ in range(len(frames) + 1):
                got.append(await asyncio.wait_for(learner.recv(), 10))
            await sender
        finally:
            push.close(linger=0)
            ctx.term()
            learner.close()
        assert learner.frames_received == len(frames) + 1
        assert learner.rejected == expected_ok.count(False)
        assert learner.last_error
        assert [m is not None for m in got[:-1]] == expected_ok
        assert isinstance(got[-1], RolloutGroup) and got[-1] == final
    asyncio.run(main())


def test_live_control_socket_answers_valid_requests_and_survives_the_rest(tmp_path):
    """Fuzzed frames into the learner's ROUTER: each valid request comes out in order, every
    other one is counted, and a last valid request still gets through."""
    addr = f"ipc://{tmp_path}/fuzz.sock"
    frames = _fuzz_frames(3000, seed=3)
    expected = [f for f in frames if _classify_control(f)]
    expected = [f for f in expected
                if not isinstance(protocol.decode(f)[1], (Announce, protocol.Welcome,
                                                          protocol.Reply))]
    final = protocol.encode(Heartbeat(producer_id="p", incarnation="i", policy_version=0,
                                      stats={}), rid=12345)

    async def main():
        learner = LearnerEndpoint(addr)
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(learner.ctl_addr)

        async def send_all():
            for f in [*frames, final]:
                await dealer.send(f)

        sender = asyncio.create_task(send_all())
        got = []
        try:
            while not got or got[-1] != 12345:
                item = await asyncio.wait_for(learner.recv_control(), 10)
                if item is not None:
                    got.append(item[1])
            await sender
        finally:
            dealer.close(linger=0)
            ctx.term()
            learner.close()
        assert got == [protocol.decode(f)[0] for f in expected] + [12345]
        assert learner.rejected == len(frames) - len(expected)
    asyncio.run(main())
