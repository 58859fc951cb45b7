"""Rollout group wire format: round trips and every class of invalid frame (control messages:
test_buffer_protocol.py)."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from buffer_factories import groups, make_completion, make_group
from hypothesis import given, settings

from buffer.schema import (
    SCHEMA_VERSION,
    Completion,
    DecodeError,
    RolloutGroup,
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


def test_sampling_segments_round_trip_and_default_frames_are_unchanged():
    g = make_group(n_completions=2, n_tokens=8)
    plain = encode(g)
    assert "sampling_segments" not in _raw(g)["body"]["completions"][0]
    g.completions[0].sampling_segments = [(0, 0.7, 0.9, 0), (5, 1.5, 1.0, 20)]
    back = decode(encode(g))
    assert back == g
    assert back.completions[0].sampling_segments == g.completions[0].sampling_segments
    temp, _top_p, top_k = back.completions[0].per_token_sampling()
    assert temp.tolist() == pytest.approx([0.7] * 5 + [1.5] * 3)
    assert top_k.tolist() == [0] * 5 + [20] * 3
    g.completions[0].sampling_segments = []
    assert encode(g) == plain


@pytest.mark.parametrize("segments, says", [
    ([[0, 0.0, 1.0, 0]], "sampling_segments"),
    ([[0, 0.7, 1.5, 0]], "sampling_segments"),
    ([[0, 0.7, 1.0, -1]], "sampling_segments"),
    ([[3, 0.7, 1.0, 0], [3, 1.0, 1.0, 0]], "strictly increasing"),
    ([[8, 0.7, 1.0, 0]], "within the completion"),
])
def test_invalid_sampling_segments_are_rejected(segments, says):
    raw = _raw(make_group(n_completions=2, n_tokens=8))
    raw["body"]["completions"][0]["sampling_segments"] = segments
    with pytest.raises(DecodeError, match=says):
        decode(_pack(raw))


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
    "schema not int": (_set(("schema",), "1"), "Expected `int`, got `str`"),
    "unknown kind": (_set(("kind",), "pickle"), "a 'pickle' frame on the data socket"),
    "missing body": (_delete(("body",)), "missing field(s) ['body']"),
    "extra top field": (_set(("extra",), 1), "unknown field"),
    "missing group field": (_delete(("body", "prompt_id")), "missing required field `prompt_id`"),
    "unknown group field": (_set(("body", "evil"), 1), "unknown field `evil`"),
    "group_id not str": (_set(("body", "group_id"), 5),
      "Expected `str`, got `int` - at `$.group_id`"),
    "token ids as list": (_set(("body", "token_ids"), [1, 2, 3]),
      "Expected `bytes`, got `array` - at `$.token_ids`"),
    "ragged bin": (_set(("body", "token_ids"), b"\x00" * 7), "not a multiple of 4"),
    "length mismatch": (_set(("body", "logprobs"), b"\x00" * 60), "16 tokens but"),
    "nan logprob": (lambda r: _set_lp(r, 3, np.nan), "finite"),
    "inf logprob": (lambda r: _set_lp(r, 3, -np.inf), "finite"),
    "positive logprob": (lambda r: _set_lp(r, 3, 0.5), "<= 0"),
    "negative token": (
        _set(("body", "token_ids"), np.full(16, -1, "<i4").tobytes()), "token ids must be >= 0"
    ),
    "no completions": (_set(("body", "completions"), []), "length >= 1 - at `$.completions`"),
    "completion not map": (_set(("body", "completions"), [1, 2]),
      "Expected `object`, got `int` - at `$.completions[0]`"),
    "num_tokens too big": (_set((*C0, "num_tokens"), 100), "need more than the 16 tokens"),
    "num_tokens too small": (_set((*C0, "num_tokens"), 1), "cover 9 tokens but 16"),
    "num_tokens negative": (_set((*C0, "num_tokens"), -1),
      ">= 0 - at `$.completions[0].num_tokens`"),
    "reward nan": (_set((*C0, "reward"), math.nan), "at `$.completions[0].reward`"),
    "reward str": (_set((*C0, "reward"), "1"), "Expected `float`, got `str`"),
    "reward bool": (_set((*C0, "reward"), True), "Expected `float`, got `bool`"),
    "breakdown not map": (_set((*C0, "reward_breakdown"), [1.0]), "Expected `object`, got `array`"),
    "breakdown value": (_set((*C0, "reward_breakdown"), {"a": "x"}), "Expected `float`, got `str`"),
    "segments empty": (_set((*C0, "version_segments"), []),
      "length >= 1 - at `$.completions[0].version_segments`"),
    "segment not pair": (_set((*C0, "version_segments"), [[0, 1, 2]]),
      "Expected `array` of length 2, got 3"),
    "segment first start": (_set((*C0, "version_segments"), [[1, 0]]), "start at 0"),
    "segment starts": (_set((*C0, "version_segments"), [[0, 0], [3, 1], [3, 2]]),
                       "strictly increasing"),
    "segment versions": (_set((*C0, "version_segments"), [[0, 5], [3, 4]]), "non-decreasing"),
    "segment beyond T": (_set((*C0, "version_segments"), [[0, 0], [8, 1]]), "out of range"),
    "segment negative": (_set((*C0, "version_segments"), [[0, -1]]),
      ">= 0 - at `$.completions[0].version_segments[0][1]`"),
    "segment float": (_set((*C0, "version_segments"), [[0, 1.0]]), "Expected `int`, got `float`"),
    "timing value": (_set(("body", "timing"), {"t": None}),
      "Expected `float`, got `None` - at `$.timing[...]`"),
    "metadata value": (_set(("body", "metadata"), {"m": [1]}),
      "Expected `int | float | str`, got `array`"),
    "body not map": (_set(("body",), [1]), "Expected `object`, got `array`"),
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
        (b"\xc1", "malformed"),
        (b"\x93\x01\x02", "Expected `object`"),  # truncated array
        (_pack([1, 2, 3]), "Expected `object`, got `array`"),
        (_pack({1: 2}), "Expected `str`, got `int` - at `key`"),  # strict_map_key
        (encode(make_group()) + b"\x00", "trailing characters"),
        (_pack(msgpack.ExtType(5, b"xx")), "ext"),
        (_pack({"schema": 1, "kind": "group", "body": msgpack.ExtType(1, b"a")}), "ext"),
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


def test_deep_nesting_is_a_decode_error():
    frame = b"\x91" * 100_000 + b"\x00"
    with pytest.raises(DecodeError):
        decode(frame)


def test_decode_error_is_value_error():
    assert issubclass(DecodeError, ValueError)
    assert Completion is not None


@pytest.mark.parametrize("kind", ["hello", "announce", "ack"])
def test_other_kinds_on_the_data_socket_are_not_a_group(kind):
    with pytest.raises(DecodeError, match="data socket") as info:
        decode(_pack({"schema": SCHEMA_VERSION, "kind": kind, "body": {}}))
    assert info.value.reason == "not_a_group"


def test_a_control_frame_is_not_a_group():
    from buffer import protocol

    frame = protocol.encode(protocol.Announce(version=1, snapshot_uri="u", snapshot_checksum="c",
                                              learner_session="s", received={}, consumed={}))
    with pytest.raises(DecodeError) as info:
        decode(frame)
    assert info.value.reason == "not_a_group"
