"""Wire format of rollout groups (the data channel): msgpack frames, never pickle.

Owns RolloutGroup / Completion and their encode/decode; the control messages are declared in
``buffer.protocol``. Invariants:

- Every frame is one msgpack map ``{"schema": SCHEMA_VERSION, "kind": <str>, "body": <map>}``
  with nothing after it.
- :func:`decode` validates every field (types, shapes, finiteness, version segments, sizes) and
  raises only :class:`DecodeError`; it never executes code or builds arbitrary objects (msgpack
  ext types are refused).
- Token ids and logprobs travel as packed little-endian binary. A group's completions are stored
  column-wise (all token ids in one blob, all logprobs in another, plus per-completion lengths),
  so validation is a handful of vectorised numpy calls per group, not per-token Python loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1

# Behaviour logprobs are <= 0 mathematically; engines may round a near-certain token to a tiny
# positive value, so allow a small slack rather than rejecting real data.
LOGPROB_EPS = 1e-3

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


class DecodeError(ValueError):
    """Any invalid frame: message says what was wrong, ``reason`` names the kind of fault for
    counting (``malformed``, or ``not_a_group`` for a well-formed frame of another kind, e.g. a
    control message sent to the data socket)."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Completion:
    """One sampled completion of a group, with per-token behaviour logprobs."""

    token_ids: np.ndarray
    """int32, shape (T,)."""
    logprobs: np.ndarray
    """float32, shape (T,): behaviour logprob of each sampled token."""
    version_segments: list[tuple[int, int]]
    """[(start_token_index, policy_version), ...]: first start is 0, starts strictly increasing
    and < T (if T > 0), versions non-decreasing. One segment unless weights changed mid-sequence."""
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""

    def per_token_versions(self) -> np.ndarray:
        """int32 (T,): the policy version that sampled each token."""
        n = len(self.token_ids)
        starts = [s for s, _ in self.version_segments]
        versions = np.fromiter((v for _, v in self.version_segments), dtype=np.int32)
        lengths = np.diff(np.asarray([*starts, n], dtype=np.int64))
        return np.repeat(versions, lengths).astype(np.int32, copy=False)

    @property
    def oldest_version(self) -> int:
        return min(v for _, v in self.version_segments)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Completion):
            return NotImplemented
        return (
            np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.logprobs, other.logprobs)
            and [tuple(s) for s in self.version_segments]
            == [tuple(s) for s in other.version_segments]
            and self.reward == other.reward
            and self.reward_breakdown == other.reward_breakdown
            and self.finish_reason == other.finish_reason
        )


@dataclass(eq=False)
class RolloutGroup:
    """One prompt and its G completions: the unit the buffer stores and never splits."""

    group_id: str
    producer_id: str
    prompt_id: str
    prompt_token_ids: np.ndarray
    """int32, shape (P,)."""
    completions: list[Completion]
    timing: dict[str, float] = field(default_factory=dict)
    """Seconds or timestamps, e.g. admitted_at, generated_s, reward_s."""
    metadata: dict[str, str | int | float] = field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        """Oldest token version over all completions; staleness is measured from this."""
        if not self.completions:
            raise ValueError(f"group {self.group_id!r} has no completions")
        return min(c.oldest_version for c in self.completions)

    @property
    def num_tokens(self) -> int:
        """Completion tokens (prompt excluded)."""
        return sum(len(c.token_ids) for c in self.completions)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutGroup):
            return NotImplemented
        return (
            self.group_id == other.group_id
            and self.producer_id == other.producer_id
            and self.prompt_id == other.prompt_id
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
            and self.completions == other.completions
            and self.timing == other.timing
            and self.metadata == other.metadata
        )



# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _as_i32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_I32)


def _as_f32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_F32)


def _fdict(d: dict[str, float]) -> dict[str, float]:
    return {str(k): float(v) for k, v in d.items()}


def _encode_group(g: RolloutGroup) -> dict[str, Any]:
    comps = g.completions
    if not comps:
        raise ValueError(f"group {g.group_id!r}: a group needs at least one completion")
    tok = _as_i32(np.concatenate([np.asarray(c.token_ids).reshape(-1) for c in comps]))
    lp = _as_f32(np.concatenate([np.asarray(c.logprobs).reshape(-1) for c in comps]))
    # Cheap producer-side checks, so a bad group fails at its source with a clear error rather
    # than being rejected (and only counted) by the learner. decode() re-checks everything.
    completions = []
    try:
        for i, c in enumerate(comps):
            n = len(c.token_ids)
            if n != len(c.logprobs):
                raise DecodeError(f"completion {i}: {n} token ids but {len(c.logprobs)} logprobs")
            segs = [[int(s), int(v)] for s, v in c.version_segments]
            _segments(segs, n, f"completion {i}.version_segments")
            completions.append(
                {
                    "num_tokens": n,
                    "version_segments": segs,
                    "reward": float(c.reward),
                    "reward_breakdown": _fdict(c.reward_breakdown),
                    "finish_reason": c.finish_reason,
                }
            )
        _check_logprobs(lp)
    except DecodeError as e:
        raise ValueError(f"invalid rollout group {g.group_id!r}: {e}") from None
    meta = {}
    for k, v in g.metadata.items():
        if isinstance(v, np.generic):
            v = v.item()
        meta[str(k)] = v
    return {
        "group_id": g.group_id,
        "producer_id": g.producer_id,
        "prompt_id": g.prompt_id,
        "prompt_token_ids": memoryview(_as_i32(g.prompt_token_ids).reshape(-1)),
        "token_ids": memoryview(tok),
        "logprobs": memoryview(lp),
        "completions": completions,
        "timing": _fdict(g.timing),
        "metadata": meta,
    }


def encode(group: RolloutGroup) -> bytes:
    """Serialise ``group`` to one frame. Raises ValueError if the group itself is invalid, so a
    producer finds out at the source rather than the learner silently rejecting the frame."""
    if not isinstance(group, RolloutGroup):
        raise TypeError(f"cannot encode {type(group).__name__}: not a RolloutGroup")
    body = _encode_group(group)
    try:
        frame = msgpack.packb({"schema": SCHEMA_VERSION, "kind": "group", "body": body})
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"cannot encode group: {e}") from e
    return frame


# --------------------------------------------------------------------------------------------
# Decoding (validation)
# --------------------------------------------------------------------------------------------


def _ext_hook(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack ext type {code} is not allowed")


def _type_name(v: Any) -> str:
    return type(v).__name__


def _str(v: Any, where: str) -> str:
    if type(v) is not str:
        raise DecodeError(f"{where}: expected str, got {_type_name(v)}")
    return v


def _int(v: Any, where: str, *, nonneg: bool = False) -> int:
    if type(v) is not int:
        raise DecodeError(f"{where}: expected int, got {_type_name(v)}")
    if nonneg and v < 0:
        raise DecodeError(f"{where}: must be >= 0, got {v}")
    return v


def _float(v: Any, where: str) -> float:
    t = type(v)
    if t is float:
        if not math.isfinite(v):
            raise DecodeError(f"{where}: must be finite, got {v}")
        return v
    if t is int:
        return float(v)
    raise DecodeError(f"{where}: expected float, got {_type_name(v)}")


def _map(v: Any, where: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise DecodeError(f"{where}: expected map, got {_type_name(v)}")
    return v


def _list(v: Any, where: str) -> list[Any]:
    if type(v) is not list:
        raise DecodeError(f"{where}: expected array, got {_type_name(v)}")
    return v


def _str_keys(d: dict[Any, Any], where: str) -> None:
    for k in d:
        if type(k) is not str:
            raise DecodeError(f"{where}: keys must be str, got {_type_name(k)}")


def _float_map(v: Any, where: str) -> dict[str, float]:
    d = _map(v, where)
    _str_keys(d, where)
    return {k: _float(x, f"{where}[{k!r}]") for k, x in d.items()}


def _scalar_map(v: Any, where: str) -> dict[str, str | int | float]:
    d = _map(v, where)
    _str_keys(d, where)
    out: dict[str, str | int | float] = {}
    for k, x in d.items():
        t = type(x)
        if t is str or t is int:
            out[k] = x
        elif t is float:
            out[k] = _float(x, f"{where}[{k!r}]")
        else:
            raise DecodeError(f"{where}[{k!r}]: expected str, int or float, got {_type_name(x)}")
    return out


def _fields(body: dict[str, Any], required: frozenset[str], where: str,
            optional: frozenset[str] = frozenset()) -> None:
    """The required fields, and optional ones added later with defaults: none missing, nothing
    unknown (a field a reader must understand needs a SCHEMA_VERSION bump, not silence)."""
    if body.keys() == required:
        return
    missing = sorted(required - body.keys())
    if missing:
        raise DecodeError(f"{where}: missing field(s) {missing}")
    unknown = sorted(str(k) for k in body.keys() - required - optional)
    if unknown:
        raise DecodeError(f"{where}: unknown field(s) {unknown}")


def _blob(v: Any, dtype: np.dtype, where: str) -> np.ndarray:
    if type(v) is not bytes:
        raise DecodeError(f"{where}: expected bin, got {_type_name(v)}")
    if len(v) % dtype.itemsize:
        raise DecodeError(
            f"{where}: {len(v)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})"
        )
    # copy() gives a writable, owned array (torch.from_numpy warns on read-only buffers).
    return np.frombuffer(v, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def _segments(v: Any, n_tokens: int, where: str) -> list[tuple[int, int]]:
    segs = _list(v, where)
    if len(segs) == 1:  # fast path: no weight swap during this completion
        seg = segs[0]
        if (
            type(seg) is list
            and len(seg) == 2
            and seg[0] == 0
            and type(seg[0]) is int
            and type(seg[1]) is int
            and seg[1] >= 0
        ):
            return [(0, seg[1])]
    if not segs:
        raise DecodeError(f"{where}: must have at least one segment")
    out: list[tuple[int, int]] = []
    prev_start = -1
    prev_version = -1
    for i, seg in enumerate(segs):
        if type(seg) is not list or len(seg) != 2:
            raise DecodeError(f"{where}[{i}]: expected [start, version] pair")
        start, version = seg
        if type(start) is not int or type(version) is not int:
            raise DecodeError(f"{where}[{i}]: start and version must be int")
        if i == 0:
            if start != 0:
                raise DecodeError(f"{where}: first segment must start at 0, got {start}")
        elif start <= prev_start:
            raise DecodeError(
                f"{where}[{i}]: starts must be strictly increasing ({start} after {prev_start})"
            )
        if start > 0 and start >= n_tokens:
            raise DecodeError(f"{where}[{i}]: start {start} out of range for {n_tokens} tokens")
        if version < 0:
            raise DecodeError(f"{where}[{i}]: policy version must be >= 0, got {version}")
        if version < prev_version:
            raise DecodeError(
                f"{where}[{i}]: versions must be non-decreasing ({version} after {prev_version})"
            )
        prev_start, prev_version = start, version
        out.append((start, version))
    return out


def _check_logprobs(lp: np.ndarray) -> None:
    if lp.size:
        if not np.isfinite(lp).all():
            raise DecodeError("group.logprobs: must be finite (found NaN or inf)")
        mx = float(lp.max())
        if mx > LOGPROB_EPS:
            raise DecodeError(f"group.logprobs: must be <= 0 (found {mx})")


_GROUP_FIELDS = frozenset((
    "group_id", "producer_id", "prompt_id", "prompt_token_ids", "token_ids", "logprobs",
    "completions", "timing", "metadata",
))
_COMPLETION_FIELDS = frozenset((
    "num_tokens", "version_segments", "reward", "reward_breakdown", "finish_reason",
))


def _decode_group(body: dict[str, Any]) -> RolloutGroup:
    _fields(body, _GROUP_FIELDS, "group")
    group_id = _str(body["group_id"], "group.group_id")
    producer_id = _str(body["producer_id"], "group.producer_id")
    prompt_id = _str(body["prompt_id"], "group.prompt_id")
    prompt = _blob(body["prompt_token_ids"], _I32, "group.prompt_token_ids")
    tok = _blob(body["token_ids"], _I32, "group.token_ids")
    lp = _blob(body["logprobs"], _F32, "group.logprobs")
    if len(tok) != len(lp):
        raise DecodeError(
            f"group.token_ids has {len(tok)} tokens but group.logprobs has {len(lp)} values"
        )
    if (prompt.size and prompt.min() < 0) or (tok.size and tok.min() < 0):
        raise DecodeError("group: token ids must be >= 0")
    _check_logprobs(lp)
    comps_raw = _list(body["completions"], "group.completions")
    if not comps_raw:
        raise DecodeError("group.completions: a group needs at least one completion")
    completions: list[Completion] = []
    offset = 0
    total = len(tok)
    for i, c in enumerate(comps_raw):
        where = f"group.completions[{i}]"
        c = _map(c, where)
        _fields(c, _COMPLETION_FIELDS, where)
        n = _int(c["num_tokens"], f"{where}.num_tokens", nonneg=True)
        if offset + n > total:
            raise DecodeError(
                f"{where}.num_tokens: completions need more than the {total} tokens sent"
            )
        completions.append(
            Completion(
                token_ids=tok[offset : offset + n],
                logprobs=lp[offset : offset + n],
                version_segments=_segments(c["version_segments"], n,
                                           f"{where}.version_segments"),
                reward=_float(c["reward"], f"{where}.reward"),
                reward_breakdown=_float_map(c["reward_breakdown"], f"{where}.reward_breakdown"),
                finish_reason=_str(c["finish_reason"], f"{where}.finish_reason"),
            )
        )
        offset += n
    if offset != total:
        raise DecodeError(
            f"group: completions cover {offset} tokens but {total} token ids were sent"
        )
    return RolloutGroup(
        group_id=group_id,
        producer_id=producer_id,
        prompt_id=prompt_id,
        prompt_token_ids=prompt,
        completions=completions,
        timing=_float_map(body["timing"], "group.timing"),
        metadata=_scalar_map(body["metadata"], "group.metadata"),
    )


def decode(frame: bytes, max_frame_bytes: int = 64 << 20) -> RolloutGroup:
    """Parse and validate one frame. Raises DecodeError (and nothing else) if it is invalid."""
    try:
        return _decode(frame, max_frame_bytes)
    except DecodeError:
        raise
    except Exception as e:  # malformed input must never escape as another exception type
        raise DecodeError(f"invalid frame: {type(e).__name__}: {e}") from None


def _decode(frame: bytes, max_frame_bytes: int) -> RolloutGroup:
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise DecodeError(f"frame must be bytes, got {_type_name(frame)}")
    size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
    if size > max_frame_bytes:
        raise DecodeError(f"frame of {size} bytes exceeds max_frame_bytes={max_frame_bytes}")
    if size == 0:
        raise DecodeError("empty frame")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_ext_hook,
            max_bin_len=max_frame_bytes,
            max_str_len=max_frame_bytes,
            max_array_len=max_frame_bytes,
            max_map_len=max_frame_bytes,
            max_ext_len=0,
        )
    except DecodeError:
        raise
    except msgpack.ExtraData:
        raise DecodeError("trailing bytes after the msgpack message") from None
    except Exception as e:
        raise DecodeError(f"not a valid msgpack frame: {type(e).__name__}: {e}") from None
    if type(obj) is not dict:
        raise DecodeError(f"frame must be a msgpack map, got {_type_name(obj)}")
    if "protocol" in obj and "schema" not in obj:
        raise DecodeError("a control frame (buffer.protocol) on the data socket", "not_a_group")
    for k in ("schema", "kind", "body"):
        if k not in obj:
            raise DecodeError(f"frame: missing field {k!r}")
    if len(obj) != 3:
        extra = sorted(str(k) for k in obj if k not in ("schema", "kind", "body"))
        raise DecodeError(f"frame: unknown field(s) {extra}")
    schema = obj["schema"]
    if type(schema) is not int:
        raise DecodeError(f"frame.schema: expected int, got {_type_name(schema)}")
    if schema != SCHEMA_VERSION:
        raise DecodeError(
            f"schema version {schema} is not supported (this build speaks {SCHEMA_VERSION})"
        )
    kind = obj["kind"]
    if type(kind) is not str:
        raise DecodeError(f"frame.kind: expected str, got {_type_name(kind)}")
    if kind != "group":
        raise DecodeError(f"a {kind!r} frame on the data socket (it carries only groups)",
                          "not_a_group")
    return _decode_group(_map(obj["body"], "group body"))
