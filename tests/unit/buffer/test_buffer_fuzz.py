"""Fuzzing: random and mutated frames to decode() and to a live LearnerEndpoint."""

from __future__ import annotations

import asyncio
import random

import msgpack
import zmq
import zmq.asyncio
from buffer_factories import make_group

from buffer.schema import Ack, Announce, DecodeError, Heartbeat, Hello, RolloutGroup, decode, encode
from buffer.transport import LearnerEndpoint

SEEDS = [
    encode(make_group("seed", n_completions=3, n_tokens=12)),
    encode(Hello("p", 1, 2)),
    encode(Heartbeat("p", 1, {"a": 1.0})),
    encode(Announce(3, "uri", "sum", "sess", {"p": 1}, {"p": 1})),
    encode(Ack("p", 3, False, "boom", {"t": 1.0})),
]


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
        keys = ["schema", "kind", "body", "group_id", "completions", "token_ids", "x"]
        return {rng.choice(keys): _random_msgpack(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return c


def _fuzz_frames(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    frames = []
    for i in range(n):
        if i % 5 == 4:
            obj = {"schema": 1, "kind": rng.choice(["group", "hello", "ack", "announce"]),
                   "body": _random_msgpack(rng)}
            frames.append(msgpack.packb(obj if rng.random() < 0.7 else _random_msgpack(rng)))
        else:
            frames.append(_mutate(rng, rng.choice(SEEDS)))
    return frames


def _classify(frame: bytes) -> bool:
    """True if decode() accepts the frame; any other exception than DecodeError fails."""
    try:
        decode(frame)
        return True
    except DecodeError as e:
        assert str(e), "DecodeError without a message"
        return False


def test_decode_fuzz_only_raises_decode_error():
    frames = _fuzz_frames(20_000, seed=1)
    accepted = sum(_classify(f) for f in frames)
    assert accepted < len(frames) // 2  # the mutations are mostly destructive
    for f in SEEDS:
        assert _classify(f)


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
