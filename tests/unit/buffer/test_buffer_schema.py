"""Wire format: round trips and every class of invalid frame."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from buffer_factories import groups, make_completion, make_group
from hypothesis import given, settings

from buffer import schema
from buffer.schema import (
    SCHEMA_VERSION,
    Ack,
    Announce,
    Completion,
    DecodeError,
    Heartbeat,
    Hello,
    RolloutGroup,
    SyncReady,
    decode,
    encode,
)


def _raw(msg) -> dict:
    """The msgpack map encode() would write, as plain Python, for mutation."""
    return msgpack.unpackb(encode(msg), raw=False)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ---- round trips ----------------------------------------------------------------------------


def test_group_round_trip_and_types():
    g = make_group(n_completions=3, n_tokens=10)
    g.completions[1] = make_completion(10, version_segments=[(0, 3), (4, 5), (9, 5)])
    out = decode(encode(g))
    assert isinstance(out, RolloutGroup)
    assert out == g
    c = out.completions[1]
    assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
    assert c.token_ids.flags.writeable  # owned arrays: torch.from_numpy will not warn
    assert c.version_segments == [(0, 3), (4, 5), (9, 5)]
    assert out.policy_version == 0
    assert out.num_tokens == 30


def test_wire_is_packed_binary_not_lists():
    g = make_group(n_completions=1, n_tokens=100)
    raw = _raw(g)
    assert raw["schema"] == SCHEMA_VERSION and raw["kind"] == "group"
    assert isinstance(raw["body"]["token_ids"], bytes)
    assert raw["body"]["token_ids"] == g.completions[0].token_ids.astype("<i4").tobytes()
    assert raw["body"]["logprobs"] == g.completions[0].logprobs.astype("<f4").tobytes()


def test_per_token_versions_and_oldest():
    c = make_completion(6, version_segments=[(0, 2), (2, 3), (5, 7)])
    assert c.per_token_versions().tolist() == [2, 2, 3, 3, 3, 7]
    assert c.per_token_versions().dtype == np.int32
    assert c.oldest_version == 2
    g = make_group(version=9)
    g.completions.append(c)
    assert g.policy_version == 2


def test_empty_completion_round_trips():
    g = make_group(n_completions=2, n_tokens=0)
    out = decode(encode(g))
    assert out == g and out.num_tokens == 0
    assert out.completions[0].per_token_versions().tolist() == []


@pytest.mark.parametrize(
    "msg",
    [
        Hello(producer_id="p-ü", policy_version=3, pid=1234),
        Heartbeat(producer_id="p", policy_version=0, stats={"tok_s": 12.5, "queued": 3}),
        Announce(version=4, snapshot_uri="file:///dev/shm/v4", snapshot_checksum="abc",
                 learner_session="s1", received={"p0": 10}, consumed={"p0": 8}),
        Ack(producer_id="p", version=4, ok=False, error="load failed", timings={"load_s": 0.5}),
        Ack(producer_id="p", version=4, ok=True),
        Hello(producer_id="p", policy_version=0, pid=7, devices=["GPU-1", "GPU-2"]),
        Announce(version=5, snapshot_uri="/s/v5", snapshot_checksum="c", learner_session="s",
                 received={}, consumed={}, routes={"p0": "nccl", "p1": "ipc"},
                 transfer={"layout": [["w", "bfloat16", [2, 3], 0]], "ipc": {
                     "handle": b"\x00\xff", "event_handle": None, "nbytes": 12,
                     "event_sync_required": True, "gpu_uuid": "GPU-1"},
                     "nccl": {"p0": {"epoch": 2, "unique_id": bytes(128)}}}),
        Announce(version=6, snapshot_uri="", snapshot_checksum="", learner_session="s",
                 received={}, consumed={}, finished=True),
        SyncReady(producer_id="p0", purpose="link", epoch=1),
        SyncReady(producer_id="p0", purpose="weights", epoch=1, version=6),
    ],
)
def test_control_round_trip(msg):
    out = decode(encode(msg))
    assert out == msg
    if isinstance(msg, Heartbeat):
        assert all(type(v) is float for v in out.stats.values())


@settings(max_examples=150, deadline=None)
@given(groups())
def test_property_any_valid_group_round_trips(g):
    out = decode(encode(g))
    assert out == g
    assert out.policy_version == g.policy_version
    for c in out.completions:
        assert c.per_token_versions().shape == c.token_ids.shape


def test_encode_refuses_invalid_groups():
    g = make_group()
    g.completions[0].logprobs = g.completions[0].logprobs[:-1]
    with pytest.raises(ValueError, match="logprobs"):
        encode(g)
    g = make_group()
    g.completions[0].version_segments = [(1, 0)]
    with pytest.raises(ValueError, match="start at 0"):
        encode(g)
    g = make_group()
    g.completions[0].logprobs[0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        encode(g)
    with pytest.raises(ValueError, match="at least one completion"):
        encode(make_group(n_completions=0))
    with pytest.raises(TypeError):
        encode("not a message")  # type: ignore[arg-type]


# ---- rejections -----------------------------------------------------------------------------


def _group_frame(mutate) -> bytes:
    raw = _raw(make_group(n_completions=2, n_tokens=8))
    mutate(raw)
    return _pack(raw)


def _set_lp(raw, i, value):
    lp = np.frombuffer(raw["body"]["logprobs"], dtype="<f4").copy()
    lp[i] = value
    raw["body"]["logprobs"] = lp.tobytes()


def _set(path, value):
    def mutate(raw):
        d = raw
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return mutate


def _delete(path):
    def mutate(raw):
        d = raw
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]

    return mutate


C0 = ("body", "completions", 0)
BAD_GROUP_FRAMES = {
    "wrong schema": (_set(("schema",), 99), "schema version 99"),
    "schema not int": (_set(("schema",), "1"), "frame.schema: expected int"),
    "unknown kind": (_set(("kind",), "pickle"), "unknown message kind 'pickle'"),
    "missing body": (_delete(("body",)), "missing field 'body'"),
    "extra top field": (_set(("extra",), 1), "unknown field"),
    "missing group field": (_delete(("body", "prompt_id")), "missing field(s) ['prompt_id']"),
    "unknown group field": (_set(("body", "evil"), 1), "unknown field(s) ['evil']"),
    "group_id not str": (_set(("body", "group_id"), 5), "group.group_id: expected str"),
    "token ids as list": (_set(("body", "token_ids"), [1, 2, 3]), "group.token_ids: expected bin"),
    "ragged bin": (_set(("body", "token_ids"), b"\x00" * 7), "not a multiple of 4"),
    "length mismatch": (_set(("body", "logprobs"), b"\x00" * 60), "16 tokens but"),
    "nan logprob": (lambda r: _set_lp(r, 3, np.nan), "finite"),
    "inf logprob": (lambda r: _set_lp(r, 3, -np.inf), "finite"),
    "positive logprob": (lambda r: _set_lp(r, 3, 0.5), "<= 0"),
    "negative token": (
        _set(("body", "token_ids"), np.full(16, -1, "<i4").tobytes()), "token ids must be >= 0"
    ),
    "no completions": (_set(("body", "completions"), []), "at least one completion"),
    "completion not map": (_set(("body", "completions"), [1, 2]), "expected map"),
    "num_tokens too big": (_set((*C0, "num_tokens"), 100), "need more than the 16 tokens"),
    "num_tokens too small": (_set((*C0, "num_tokens"), 1), "cover 9 tokens but 16"),
    "num_tokens negative": (_set((*C0, "num_tokens"), -1), "must be >= 0"),
    "reward nan": (_set((*C0, "reward"), math.nan), "reward: must be finite"),
    "reward str": (_set((*C0, "reward"), "1"), "reward: expected float"),
    "reward bool": (_set((*C0, "reward"), True), "reward: expected float"),
    "breakdown not map": (_set((*C0, "reward_breakdown"), [1.0]), "expected map"),
    "breakdown value": (_set((*C0, "reward_breakdown"), {"a": "x"}), "expected float"),
    "segments empty": (_set((*C0, "version_segments"), []), "at least one segment"),
    "segment not pair": (_set((*C0, "version_segments"), [[0, 1, 2]]), "pair"),
    "segment first start": (_set((*C0, "version_segments"), [[1, 0]]), "start at 0"),
    "segment starts": (_set((*C0, "version_segments"), [[0, 0], [3, 1], [3, 2]]),
                       "strictly increasing"),
    "segment versions": (_set((*C0, "version_segments"), [[0, 5], [3, 4]]), "non-decreasing"),
    "segment beyond T": (_set((*C0, "version_segments"), [[0, 0], [8, 1]]), "out of range"),
    "segment negative": (_set((*C0, "version_segments"), [[0, -1]]), "must be >= 0"),
    "segment float": (_set((*C0, "version_segments"), [[0, 1.0]]), "must be int"),
    "timing value": (_set(("body", "timing"), {"t": None}), "group.timing['t']: expected float"),
    "metadata value": (_set(("body", "metadata"), {"m": [1]}), "expected str, int or float"),
    "body not map": (_set(("body",), [1]), "group body: expected map"),
}


@pytest.mark.parametrize("name", sorted(BAD_GROUP_FRAMES))
def test_invalid_group_frames_rejected(name):
    mutate, expected = BAD_GROUP_FRAMES[name]
    with pytest.raises(DecodeError) as info:
        decode(_group_frame(mutate))
    assert expected in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "frame, expected",
    [
        (b"", "empty frame"),
        (b"\xc1", "not a valid msgpack frame"),
        (b"\x93\x01\x02", "not a valid msgpack frame"),  # truncated array
        (_pack([1, 2, 3]), "must be a msgpack map"),
        (_pack({1: 2}), "not a valid msgpack frame"),  # strict_map_key
        (encode(Hello("p", 0, 1)) + b"\x00", "trailing bytes"),
        (_pack(msgpack.ExtType(5, b"xx")), "ext"),
        (_pack({"schema": 1, "kind": "hello", "body": msgpack.ExtType(1, b"a")}), "ext"),
        (b"\xd6\xff\x00\x00\x00\x01", "ext"),  # msgpack timestamp ext
        ("not bytes", "frame must be bytes"),
    ],
)
def test_garbage_rejected(frame, expected):
    with pytest.raises(DecodeError) as info:
        decode(frame)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_oversized_frame_rejected():
    frame = encode(make_group(n_tokens=1000))
    with pytest.raises(DecodeError, match="exceeds max_frame_bytes"):
        decode(frame, max_frame_bytes=len(frame) - 1)
    assert isinstance(decode(frame, max_frame_bytes=len(frame)), RolloutGroup)


@pytest.mark.parametrize(
    "msg, mutate, expected",
    [
        (Hello("p", 0, 1), _set(("body", "pid"), "1"), "hello.pid: expected int"),
        (Hello("p", 0, 1), _set(("body", "policy_version"), -1), "must be >= 0"),
        (Hello("p", 0, 1), _set(("body", "pid"), True), "expected int, got bool"),
        (Heartbeat("p", 0, {}), _set(("body", "stats"), {"x": math.inf}), "finite"),
        (Announce(1, "u", "c", "s", {}, {}), _set(("body", "received"), {"p": 1.5}),
         "expected int"),
        (Announce(1, "u", "c", "s", {}, {}), _delete(("body", "consumed")), "missing"),
        (Ack("p", 1, True), _set(("body", "ok"), 1), "ack.ok: expected bool"),
        (Hello("p", 0, 1), _set(("body", "devices"), ["GPU-1", 3]), "hello.devices[1]"),
        (Hello("p", 0, 1), _set(("body", "gpus"), []), "hello: unknown field"),
        (Announce(1, "u", "c", "s", {}, {}), _set(("body", "routes"), {"p0": 1}),
         "announce.routes['p0']: expected str"),
        (Announce(1, "u", "c", "s", {}, {}), _set(("body", "transfer"), {"x": [math.nan]}),
         "finite"),
        (Announce(1, "u", "c", "s", {}, {}), _set(("body", "transfer"), {1: "x"}), "map key"),
        (Announce(1, "u", "c", "s", {}, {}), _set(("body", "transfer"), [1]), "expected map"),
        (Announce(1, "u", "c", "s", {}, {}), _set(("body", "transfer"), {"d": [[[[[[[[[1]]]]]]]]]}),
         "nested deeper"),
        (SyncReady("p", "link", 1), _set(("body", "purpose"), "other"), "expected 'link'"),
        (SyncReady("p", "link", 1), _delete(("body", "epoch")), "missing"),
    ],
)
def test_invalid_control_frames_rejected(msg, mutate, expected):
    raw = _raw(msg)
    mutate(raw)
    with pytest.raises(DecodeError, match=expected.replace("[", r"\[").replace(".", r"\.")):
        decode(_pack(raw))


def test_deep_nesting_is_a_decode_error():
    frame = b"\x91" * 100_000 + b"\x00"
    with pytest.raises(DecodeError):
        decode(frame)


def test_decode_error_is_value_error():
    assert issubclass(DecodeError, ValueError)
    assert schema.Message is not None
    assert Completion is not None


def test_new_optional_fields_are_omitted_when_unset_so_older_readers_still_decode():
    """Frames that do not use the GPU transports are byte-for-byte what the previous schema
    wrote, and a frame from an older writer (no routes/transfer/devices) decodes with defaults."""
    ann = Announce(1, "u", "c", "s", {"p": 1}, {"p": 0})
    raw = _raw(ann)
    assert "routes" not in raw["body"] and "transfer" not in raw["body"]
    assert "devices" not in _raw(Hello("p", 0, 1))["body"]
    out = decode(_pack(raw))
    assert out.routes == {} and out.transfer == {}
    assert decode(_pack(_raw(Hello("p", 0, 1)))).devices == []


def test_transfer_payload_refuses_msgpack_ext():
    raw = _raw(Announce(1, "u", "c", "s", {}, {}))
    raw["body"]["transfer"] = {"x": msgpack.ExtType(1, b"obj")}
    with pytest.raises(DecodeError, match="ext"):
        decode(msgpack.packb(raw))
