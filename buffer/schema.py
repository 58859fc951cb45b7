"""Wire format of rollout groups (the data channel): msgpack frames, never pickle.

Owns RolloutGroup / Completion and their encode/decode; the control messages are declared in
``buffer.protocol``. Invariants:

- Every frame is one msgpack map ``{"schema": SCHEMA_VERSION, "kind": <str>, "body": <map>}``
  with nothing after it.
- The wire layout is declared once, as msgspec Structs (``_GroupWire``), and both encode and
  decode go through it. :func:`decode` validates every field (types, shapes, finiteness,
  version segments, sizes) and raises only :class:`DecodeError`; it never executes code or
  builds arbitrary objects (msgpack ext types are refused).
- Token ids and logprobs travel as packed little-endian binary. A group's completions are stored
  column-wise (all token ids in one blob, all logprobs in another, plus per-completion lengths),
  so validation is a handful of vectorised numpy calls per group, not per-token Python loops.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta, Struct

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
    masked_spans: list[tuple[int, int]] = field(default_factory=list)
    """[(start, end), ...]: token ranges the policy did not sample (tool or environment output
    between the turns of an episode), sorted, disjoint, within [0, T). They are context for the
    tokens after them and are left out of the loss; their logprobs are 0 and carry no meaning.
    Empty for a single-turn completion (the wire then omits the field)."""
    sampling_segments: list[tuple[int, float, float, int]] = field(default_factory=list)
    """[(start_token_index, temperature, top_p, top_k), ...]: the distribution the engine drew
    the tokens from ``start`` on (top_k 0: no top-k), starts strictly increasing and < T. Tokens
    before the first start, and every token when empty, were drawn from the untempered,
    untruncated distribution (1.0, 1.0, 0): the learner computes each token's logprob from the
    same distribution (an episode's turns may each override it)."""

    def loss_mask(self) -> np.ndarray:
        """bool (T,): True on tokens the policy sampled (trained on), False on masked spans."""
        keep = np.ones(len(self.token_ids), dtype=bool)
        for start, end in self.masked_spans:
            keep[start:end] = False
        return keep

    def per_token_versions(self) -> np.ndarray:
        """int32 (T,): the policy version that sampled each token."""
        n = len(self.token_ids)
        starts = [s for s, _ in self.version_segments]
        versions = np.fromiter((v for _, v in self.version_segments), dtype=np.int32)
        lengths = np.diff(np.asarray([*starts, n], dtype=np.int64))
        return np.repeat(versions, lengths).astype(np.int32, copy=False)

    def per_token_sampling(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32 temperature, float32 top_p and int32 top_k of each token, shape (T,) each."""
        n = len(self.token_ids)
        temp = np.ones(n, dtype=np.float32)
        top_p = np.ones(n, dtype=np.float32)
        top_k = np.zeros(n, dtype=np.int32)
        segs = self.sampling_segments
        ends = [s for s, *_ in segs[1:]] + [n] if segs else []
        for (start, t, p, k), end in zip(segs, ends, strict=True):
            temp[start:end], top_p[start:end], top_k[start:end] = t, p, k
        return temp, top_p, top_k

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
            and [tuple(s) for s in self.masked_spans] == [tuple(s) for s in other.masked_spans]
            and [tuple(s) for s in self.sampling_segments]
            == [tuple(s) for s in other.sampling_segments]
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
# The wire declaration (msgspec Structs): one for both directions. Decoding against it checks
# types, required and unknown fields, finite floats and refuses ext types; what a type cannot
# express (blob sizes, token coverage, version segments, logprob range) is checked after it.
# --------------------------------------------------------------------------------------------
_Count = Annotated[int, Meta(ge=0)]
_Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
_Temperature = Annotated[float, Meta(gt=0, le=sys.float_info.max)]
_TopP = Annotated[float, Meta(gt=0, le=1)]


class _CompletionWire(Struct, forbid_unknown_fields=True, omit_defaults=True):
    num_tokens: _Count
    version_segments: Annotated[list[tuple[_Count, _Count]], Meta(min_length=1)]
    reward: _Finite
    reward_breakdown: dict[str, _Finite]
    finish_reason: str
    # Optional, omitted when empty: frames of single-turn completions are byte-for-byte those
    # of a build without it, and decode where it is unknown.
    masked_spans: list[tuple[_Count, _Count]] = []
    # Omitted when every token was drawn at temperature 1 with no truncation (the same rule).
    sampling_segments: list[tuple[_Count, _Temperature, _TopP, _Count]] = []


class _GroupWire(Struct, forbid_unknown_fields=True):
    group_id: str
    producer_id: str
    prompt_id: str
    prompt_token_ids: bytes
    token_ids: bytes
    logprobs: bytes
    completions: Annotated[list[_CompletionWire], Meta(min_length=1)]
    timing: dict[str, _Finite]
    metadata: dict[str, str | int | _Finite]


class _GroupFrame(Struct):
    schema: int
    kind: str
    body: _GroupWire


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _as_i32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_I32)


def _as_f32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_F32)


def _fdict(d: dict[str, float]) -> dict[str, float]:
    return {str(k): float(v) for k, v in d.items()}


def _encode_group(g: RolloutGroup) -> _GroupWire:
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
            segs = [(int(s), int(v)) for s, v in c.version_segments]
            _segments(segs, n, f"completion {i}.version_segments")
            spans = [(int(a), int(b)) for a, b in c.masked_spans]
            _spans(spans, n, f"completion {i}.masked_spans")
            sampling = _sampling_segments(
                [(int(s), float(t), float(p), int(k)) for s, t, p, k in c.sampling_segments],
                n, f"completion {i}.sampling_segments")
            completions.append(_CompletionWire(
                num_tokens=n, version_segments=segs, reward=float(c.reward),
                reward_breakdown=_fdict(c.reward_breakdown), finish_reason=c.finish_reason,
                masked_spans=spans, sampling_segments=sampling))
        _check_logprobs(lp)
    except DecodeError as e:
        raise ValueError(f"invalid rollout group {g.group_id!r}: {e}") from None
    meta = {str(k): v.item() if isinstance(v, np.generic) else v for k, v in g.metadata.items()}
    # memoryviews: msgspec writes them as bin without another copy.
    return _GroupWire(
        group_id=g.group_id, producer_id=g.producer_id, prompt_id=g.prompt_id,
        prompt_token_ids=memoryview(_as_i32(g.prompt_token_ids).reshape(-1)),  # type: ignore[arg-type]
        token_ids=memoryview(tok), logprobs=memoryview(lp),  # type: ignore[arg-type]
        completions=completions, timing=_fdict(g.timing), metadata=meta)


_encoder = msgspec.msgpack.Encoder()


def encode(group: RolloutGroup) -> bytes:
    """Serialise ``group`` to one frame. Raises ValueError if the group itself is invalid, so a
    producer finds out at the source rather than the learner silently rejecting the frame."""
    if not isinstance(group, RolloutGroup):
        raise TypeError(f"cannot encode {type(group).__name__}: not a RolloutGroup")
    body = _encode_group(group)
    try:
        return _encoder.encode(_GroupFrame(SCHEMA_VERSION, "group", body))
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
        raise ValueError(f"cannot encode group: {e}") from e


# --------------------------------------------------------------------------------------------
# Decoding: the wire declaration (msgspec Structs: types, required and unknown fields, finite
# floats, no ext types) plus the checks a type cannot express (blob sizes, token coverage,
# version segments, logprob range), vectorised over the whole group.
# --------------------------------------------------------------------------------------------
_top_decoder = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_int_decoder = msgspec.msgpack.Decoder(int)
_str_decoder = msgspec.msgpack.Decoder(str)
_group_decoder = msgspec.msgpack.Decoder(_GroupWire)
_FRAME_FIELDS = {"schema", "kind", "body"}


def _blob(v: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(v) % dtype.itemsize:
        raise DecodeError(
            f"{where}: {len(v)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})"
        )
    # copy() gives a writable, owned array (torch.from_numpy warns on read-only buffers).
    return np.frombuffer(v, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def _segments(segs: list[tuple[int, int]], n_tokens: int, where: str) -> list[tuple[int, int]]:
    """Version segments of one completion: first start 0, starts strictly increasing and below
    n_tokens, versions >= 0 and non-decreasing."""
    if len(segs) == 1 and segs[0][0] == 0 and segs[0][1] >= 0:
        return [(0, segs[0][1])]  # fast path: no weight swap during this completion
    if not segs:
        raise DecodeError(f"{where}: must have at least one segment")
    prev_start = prev_version = -1
    for i, (start, version) in enumerate(segs):
        if i == 0 and start != 0:
            raise DecodeError(f"{where}: first segment must start at 0, got {start}")
        if i and start <= prev_start:
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
    return [(int(s), int(v)) for s, v in segs]


def span_error(spans: list[tuple[int, int]], n_tokens: int) -> str:
    """What is wrong with ``spans`` as the masked spans of ``n_tokens`` tokens ('' if nothing):
    each ``start < end <= n_tokens``, sorted and disjoint."""
    prev_end = 0
    for i, (start, end) in enumerate(spans):
        if not prev_end <= start < end <= n_tokens:
            return (f"[{i}] = ({start}, {end}) must satisfy {prev_end} <= start < end <= "
                    f"{n_tokens} (sorted, disjoint, within the completion)")
        prev_end = end
    return ""


def _spans(spans: list[tuple[int, int]], n_tokens: int, where: str) -> list[tuple[int, int]]:
    err = span_error(spans, n_tokens)
    if err:
        raise DecodeError(f"{where}{err}")
    return [(int(a), int(b)) for a, b in spans]


def _sampling_segments(segs: list[tuple[int, float, float, int]], n_tokens: int, where: str
                       ) -> list[tuple[int, float, float, int]]:
    """Sampling segments of one completion: starts strictly increasing and below n_tokens,
    temperature > 0 and finite, 0 < top_p <= 1, top_k >= 0."""
    prev = -1
    for i, (start, temp, top_p, top_k) in enumerate(segs):
        if start <= prev or (start and start >= n_tokens):
            raise DecodeError(f"{where}[{i}]: start {start} must be above {prev} and below "
                              f"{n_tokens} (strictly increasing, within the completion)")
        if not (0 < temp < float("inf") and 0 < top_p <= 1 and top_k >= 0):
            raise DecodeError(f"{where}[{i}]: ({temp}, {top_p}, {top_k}) needs temperature > 0,"
                              " 0 < top_p <= 1, top_k >= 0")
        prev = start
    return [(int(s), float(t), float(p), int(k)) for s, t, p, k in segs]


def _check_logprobs(lp: np.ndarray) -> None:
    if lp.size:
        if not np.isfinite(lp).all():
            raise DecodeError("group.logprobs: must be finite (found NaN or inf)")
        mx = float(lp.max())
        if mx > LOGPROB_EPS:
            raise DecodeError(f"group.logprobs: must be <= 0 (found {mx})")


def _decode_group(w: _GroupWire) -> RolloutGroup:
    prompt = _blob(w.prompt_token_ids, _I32, "group.prompt_token_ids")
    tok = _blob(w.token_ids, _I32, "group.token_ids")
    lp = _blob(w.logprobs, _F32, "group.logprobs")
    if len(tok) != len(lp):
        raise DecodeError(
            f"group.token_ids has {len(tok)} tokens but group.logprobs has {len(lp)} values"
        )
    if (prompt.size and prompt.min() < 0) or (tok.size and tok.min() < 0):
        raise DecodeError("group: token ids must be >= 0")
    _check_logprobs(lp)
    completions: list[Completion] = []
    offset, total = 0, len(tok)
    for i, c in enumerate(w.completions):
        n = c.num_tokens
        if offset + n > total:
            raise DecodeError(f"group.completions[{i}].num_tokens: completions need more than "
                              f"the {total} tokens sent")
        segs = _segments(c.version_segments, n, f"group.completions[{i}].version_segments")
        spans = _spans(c.masked_spans, n, f"group.completions[{i}].masked_spans") \
            if c.masked_spans else []
        sampling = _sampling_segments(c.sampling_segments, n,
                                      f"group.completions[{i}].sampling_segments") \
            if c.sampling_segments else []
        completions.append(Completion(
            token_ids=tok[offset : offset + n], logprobs=lp[offset : offset + n],
            version_segments=segs, reward=c.reward, reward_breakdown=c.reward_breakdown,
            finish_reason=c.finish_reason, masked_spans=spans, sampling_segments=sampling))
        offset += n
    if offset != total:
        raise DecodeError(
            f"group: completions cover {offset} tokens but {total} token ids were sent"
        )
    return RolloutGroup(group_id=w.group_id, producer_id=w.producer_id, prompt_id=w.prompt_id,
                        prompt_token_ids=prompt, completions=completions, timing=w.timing,
                        metadata=w.metadata)


def decode(frame: bytes, max_frame_bytes: int = 64 << 20) -> RolloutGroup:
    """Parse and validate one frame. Raises DecodeError (and nothing else) if it is invalid."""
    try:
        return _decode(frame, max_frame_bytes)
    except DecodeError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"invalid group frame: {e}") from None
    except Exception as e:  # malformed input must never escape as another exception type
        raise DecodeError(f"invalid frame: {type(e).__name__}: {e}") from None


def _decode(frame: bytes, max_frame_bytes: int) -> RolloutGroup:
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise DecodeError(f"frame must be bytes, got {type(frame).__name__}")
    size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
    if size > max_frame_bytes:
        raise DecodeError(f"frame of {size} bytes exceeds max_frame_bytes={max_frame_bytes}")
    if size == 0:
        raise DecodeError("empty frame")
    top = _top_decoder.decode(frame)
    if "protocol" in top and "schema" not in top:
        raise DecodeError("a control frame (buffer.protocol) on the data socket", "not_a_group")
    if top.keys() != _FRAME_FIELDS:
        missing = sorted(_FRAME_FIELDS - top.keys())
        raise DecodeError(f"frame: missing field(s) {missing}" if missing else
                          f"frame: unknown field(s) {sorted(top.keys() - _FRAME_FIELDS)}")
    schema = _int_decoder.decode(top["schema"])
    if schema != SCHEMA_VERSION:
        raise DecodeError(
            f"schema version {schema} is not supported (this build speaks {SCHEMA_VERSION})"
        )
    kind = _str_decoder.decode(top["kind"])
    if kind != "group":
        raise DecodeError(f"a {kind!r} frame on the data socket (it carries only groups)",
                          "not_a_group")
    return _decode_group(_group_decoder.decode(top["body"]))
