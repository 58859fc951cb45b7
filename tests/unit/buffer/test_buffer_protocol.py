"""Control messages: round trips, and every class of invalid frame refused by the declaration."""

from __future__ import annotations

import math

import msgpack
import pytest

from buffer import protocol
from buffer.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Announce,
    Heartbeat,
    Hello,
    Leave,
    ProtocolError,
    Reply,
    SyncReady,
    Welcome,
    decode,
    encode,
)


def hello(**kw) -> Hello:
    return Hello(
        **{"producer_id": "p0", "incarnation": "p0-1-2", "policy_version": 0, "pid": 1, **kw}
    )


def announce(**kw) -> Announce:
    return Announce(
        **{
            "version": 1,
            "snapshot_uri": "u",
            "snapshot_checksum": "c",
            "learner_session": "s",
            "received": {},
            "consumed": {},
            **kw,
        }
    )


def _raw(msg) -> dict:
    """The message map encode() writes, as plain Python, for mutation."""
    return msgpack.unpackb(encode(msg))["msg"]


def _frame(body: dict, protocol_version: int = PROTOCOL_VERSION, rid: int = 0) -> bytes:
    return msgpack.packb({"protocol": protocol_version, "rid": rid, "msg": body})


MESSAGES = [
    hello(producer_id="p-ü"),
    hello(devices=["GPU-1", "GPU-2"], recovered=["p0-0-1"]),
    Heartbeat(
        producer_id="p0", incarnation="i", policy_version=0, stats={"tok_s": 12.5, "queued": 3.0}
    ),
    Ack(
        producer_id="p0",
        incarnation="i",
        version=4,
        ok=False,
        error="load failed",
        timings={"load_s": 0.5},
    ),
    Ack(producer_id="p0", incarnation="i", version=4, ok=True),
    SyncReady(producer_id="p0", incarnation="i", purpose="link", epoch=1),
    SyncReady(producer_id="p0", incarnation="i", purpose="weights", epoch=1, version=6),
    Welcome(producer_id="p0", incarnation="i", learner_session="s"),
    Reply(ok=False, reason="unknown_producer"),
    announce(received={"p0": 10}, consumed={"p0": 8}),
    announce(
        routes={"p0": "nccl", "p1": "ipc"},
        transfer={
            "layout": [["w", "bfloat16", [2, 3], 0]],
            "ipc": {
                "handle": b"\x00\xff",
                "event_handle": None,
                "nbytes": 12,
                "event_sync_required": True,
                "gpu_uuid": "GPU-1",
            },
            "nccl": {"p0": {"epoch": 2, "unique_id": bytes(128)}},
        },
    ),
    announce(finished=True),
    announce(members=["p0", "p2"]),
    announce(last_step=40, steps_taken=39),
    Leave(producer_id="p1", incarnation="i", sent=12),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    rid, out = decode(encode(msg, rid=7))
    assert rid == 7 and out == msg and type(out) is type(msg)


def test_defaults_are_not_written():
    raw = _raw(announce())
    assert raw["kind"] == "announce"
    assert not {"routes", "transfer", "finished", "cursors", "last_step"} & raw.keys()
    assert "devices" not in _raw(hello())


@pytest.mark.parametrize(
    "msg, field, value, expected",
    [
        (hello(), "pid", "1", "Expected `int`, got `str` - at `$.pid`"),
        (hello(), "pid", True, "Expected `int`, got `bool`"),
        (hello(), "policy_version", -1, "Expected `int` >= 0"),
        (hello(), "producer_id", "", "length >= 1"),
        (hello(), "producer_id", "x" * 257, "length <= 256"),
        (hello(), "devices", ["GPU-1", 3], "at `$.devices[1]`"),
        (hello(), "gpus", [], "unknown field `gpus`"),
        (hello(), "kind", "pickle", "Invalid value 'pickle'"),
        (
            Heartbeat(producer_id="p", incarnation="i", policy_version=0, stats={}),
            "stats",
            {"x": math.inf},
            "Expected `float` <=",
        ),
        (
            Heartbeat(producer_id="p", incarnation="i", policy_version=0, stats={}),
            "stats",
            {"x": math.nan},
            "Expected `float`",
        ),
        (announce(), "received", {"p": 1.5}, "Expected `int`, got `float`"),
        (announce(), "last_step", -1, "Expected `int` >= 0"),
        (announce(), "consumed", None, "Expected `object`, got `None`"),
        (announce(), "routes", {"p0": "carrier-pigeon"}, "Invalid enum value"),
        (announce(), "transfer", {"x": [math.nan]}, "must be finite"),
        (announce(), "transfer", [1], "Expected `object`, got `array`"),
        (announce(), "transfer", {"d": [[[[[[[[[1]]]]]]]]]}, "nested deeper"),
        (announce(), "transfer", {"x": msgpack.ExtType(1, b"obj")}, "not plain msgpack data"),
        (
            Ack(producer_id="p", incarnation="i", version=1, ok=True),
            "ok",
            1,
            "Expected `bool`, got `int`",
        ),
        (
            SyncReady(producer_id="p", incarnation="i", purpose="link", epoch=1),
            "purpose",
            "x",
            "Invalid enum value 'x'",
        ),
    ],
)
def test_invalid_messages_refused(msg, field, value, expected):
    raw = _raw(msg)
    raw[field] = value
    with pytest.raises(ProtocolError) as info:
        decode(_frame(raw))
    assert expected in str(info.value)


def test_missing_field_refused():
    raw = _raw(SyncReady(producer_id="p", incarnation="i", purpose="link", epoch=1))
    del raw["epoch"]
    with pytest.raises(ProtocolError, match="missing required field `epoch`"):
        decode(_frame(raw))


@pytest.mark.parametrize(
    "frame, expected",
    [
        (b"", "truncated"),
        (b"\xc1", "malformed"),
        (msgpack.packb([1, 2, 3]), "Expected `object`"),
        (encode(hello()) + b"\x00", "trailing characters"),
        (_frame({"kind": "hello"}, protocol_version=99), "protocol version 99"),
        (msgpack.packb({"protocol": 1, "rid": 0}), "missing required field `msg`"),
        (msgpack.packb({"protocol": 1, "rid": -1, "msg": {}}), ">= 0"),
        (msgpack.packb({"schema": 1, "kind": "group", "body": {}}), "unknown field"),
        (b"\x91" * 100_000 + b"\x00", ""),
    ],
)
def test_garbage_refused(frame, expected):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert expected in str(info.value)


def test_oversized_frame_refused():
    frame = encode(hello())
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(frame, max_bytes=len(frame) - 1)


def test_encode_checks_the_declaration_at_the_sender():
    with pytest.raises(ValueError, match="invalid Hello"):
        encode(hello(policy_version=-1))
    with pytest.raises(ValueError, match="invalid Heartbeat"):
        encode(Heartbeat(producer_id="p", incarnation="i", policy_version=0, stats={"x": math.nan}))
    with pytest.raises(ValueError, match="nested deeper"):
        announce(transfer={"d": [[[[[[[[[1]]]]]]]]]})  # checked when built
    with pytest.raises(TypeError):
        encode({"kind": "hello"})  # type: ignore[arg-type]


def test_protocol_error_is_value_error():
    assert issubclass(ProtocolError, ValueError)
    assert protocol.MAX_CONTROL_BYTES >= 1 << 20
