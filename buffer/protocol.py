"""Control messages between producers and the learner, each declared once.

Every message is a msgspec ``Struct``: its annotations are the declaration (field names, types,
limits), and msgpack encoding and typed decoding both come from it, so there is no hand-written
encoder or validator to keep in step. Rollout groups, the bulk data, have their own format in
``buffer.schema``.

Channels (``buffer.transport``):

    producer DEALER ──(Hello, Heartbeat, Ack, SyncReady, EvalResult)──► learner ROUTER  control
    producer DEALER ◄──────────(Welcome, Reply)──────────── learner ROUTER
    producer SUB    ◄──────────────(Announce)────────────── learner PUB     broadcast

Invariants:
- A frame is one msgpack map ``{"protocol": PROTOCOL_VERSION, "rid": <int>, "msg": <message>}``;
  the message map carries its type in ``"kind"``. ``rid`` numbers a producer's requests; the
  learner's answer echoes it.
- :func:`decode` raises only :class:`ProtocolError`: unknown kinds or fields, wrong types,
  out-of-range values, strings or maps beyond their limit, non-finite floats, msgpack ext types
  and trailing bytes are all refused. Nothing is ever unpickled or constructed from the wire
  beyond these Structs and plain data.
- :func:`encode` checks the message against the same declaration (it decodes what it wrote), so
  a bad message fails at its sender with a clear error rather than being dropped by the peer.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 1
MAX_CONTROL_BYTES = 4 << 20
"""Control frames are small; a larger one is refused (ZMQ_MAXMSGSIZE and :func:`decode`)."""

_MAX_PLAIN_DEPTH = 8

# ---- field types: the limits every declaration below is built from ---------------------------
Name = Annotated[str, Meta(min_length=1, max_length=256)]
"""A producer id, incarnation, learner session or map key."""
Text = Annotated[str, Meta(max_length=16384)]
"""Free text: URIs, checksums, error messages."""
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
"""Versions, epochs, pids, counters."""
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""Any finite float (the bounds refuse inf and NaN)."""
Stats = Annotated[dict[Name, Finite], Meta(max_length=1024)]
Counts = Annotated[dict[Name, Count], Meta(max_length=65536)]


class _Message(
    Struct, tag_field="kind", forbid_unknown_fields=True, omit_defaults=True, kw_only=True
):
    """Base of every message: ``kind`` on the wire is the class's tag."""


# ---- producer -> learner (control channel) --------------------------------------------------
class Hello(_Message, tag="hello"):
    """A producer introduces itself; nothing else it sends is accepted before the learner's
    Welcome. Sent at start, and again to a learner that does not know it (a restarted one)."""

    producer_id: Name
    incarnation: Name
    """This producer process (id, pid, start time): every group it sends carries it."""
    policy_version: Count
    pid: Count
    devices: Annotated[list[Name], Meta(max_length=64)] = []
    """GPU UUID of each of the producer's vLLM workers ([] on CPU): the learner picks the weight
    transport per producer from it (same GPU: ipc, another GPU: nccl)."""
    recovered: Annotated[list[Name], Meta(max_length=4096)] = []
    """Incarnations of dead processes with the same producer id whose unconfirmed groups this
    one resends (``pipeline.producer.outbox``); their groups are accepted from it."""
    leaving: bool = False
    """The producer is leaving the run (elastic runs): a restarted learner must not make it a
    member again; it only waits for the checkpoint of its groups."""


class Heartbeat(_Message, tag="heartbeat"):
    """Periodic liveness and throughput statistics from a producer."""

    producer_id: Name
    incarnation: Name
    policy_version: Count
    stats: Stats
    cursor: Count = 0
    """Positions of its data leases read so far (the learner tops its leases up from it)."""
    leaving: bool = False
    """Asked to leave (elastic runs): should it die before its Leave, the learner takes it out
    once it falls silent, rather than keep its share for good."""


class Ack(_Message, tag="ack"):
    """The result of loading an announced version."""

    producer_id: Name
    incarnation: Name
    version: Count
    ok: bool
    error: Text = ""
    timings: Stats = {}


class SyncReady(_Message, tag="sync_ready"):
    """For the NCCL transport (a collective: both sides must take part).

    ``purpose`` "link": the producer is about to join link ``epoch`` (the learner joins too);
    "weights": the producer is paused and waits on link ``epoch`` for ``version``;
    "drop": the producer gave link ``epoch`` up (a join or receive failed or timed out on its
    side), so the learner drops it too and offers a new one; without this the two sides could
    disagree for good about whether the link is up."""

    producer_id: Name
    incarnation: Name
    purpose: Literal["link", "weights", "drop"]
    epoch: Count
    version: Count = 0


class EvalResult(_Message, tag="eval_result"):
    """The figures of one evaluation on held-out prompts (``pipeline.producer.evaluation``), run
    on weights ``version``. Evaluation completions never travel: they are not rollout groups."""

    producer_id: Name
    incarnation: Name
    version: Count
    stats: Stats
    """``eval/reward_mean``, ``eval/pass@k``, ``eval/<reward>`` and the like."""


class Leave(_Message, tag="leave"):
    """The producer leaves the run (elastic runs, ``max_producers``): it starts no more groups
    and every one it started has reached the learner (``sent`` of them). The learner takes it
    out of ``Announce.members``, so the others take over its admission share and data, and
    checkpoints its groups at the next step; the producer exits once they are durable."""

    producer_id: Name
    incarnation: Name
    sent: Count
    cursor: Count = 0
    """Positions of its data leases read: the rest go to the other producers."""


# ---- learner -> producer (control channel replies) ------------------------------------------
class Welcome(_Message, tag="welcome"):
    """The answer to a Hello: the learner has recorded this incarnation."""

    producer_id: Name
    incarnation: Name
    learner_session: Name


class Reply(_Message, tag="reply"):
    """The answer to every other control message: taken (``ok``), or refused with ``reason``
    (e.g. "unknown_producer": say Hello first)."""

    ok: bool
    reason: Text = ""


# ---- learner -> producers (broadcast) -------------------------------------------------------
def _plain(v: Any, where: str, depth: int = 0) -> None:
    """Plain data only (nil, bool, int, finite float, str, bin, lists, str-keyed maps), nested
    at most _MAX_PLAIN_DEPTH deep."""
    if depth > _MAX_PLAIN_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_PLAIN_DEPTH}")
    if v is None or type(v) in (bool, int, str, bytes):
        return
    if type(v) is float:
        if not math.isfinite(v):
            raise ValueError(f"{where}: must be finite, got {v}")
    elif type(v) in (list, tuple):
        for i, x in enumerate(v):
            _plain(x, f"{where}[{i}]", depth + 1)
    elif type(v) is dict:
        for k, x in v.items():
            if type(k) is not str:
                raise ValueError(f"{where}: map keys must be str, got {type(k).__name__}")
            _plain(x, f"{where}.{k}", depth + 1)
    else:
        raise ValueError(f"{where}: {type(v).__name__} is not plain msgpack data")


class Announce(_Message, tag="announce"):
    """Weights ``version`` are ready at ``snapshot_uri``, with the learner's per-producer counts.
    Re-published every second, so a producer that (re)connects catches up."""

    version: Count
    snapshot_uri: Text
    snapshot_checksum: Text
    learner_session: Name
    received: Counts
    """Groups received per producer so far (lets producers detect loss across restarts)."""
    consumed: Counts
    """Groups consumed (served to training) per producer so far."""
    cursors: Counts = {}
    """Highest dataset cursor received per producer (where a restarted producer resumes)."""
    durable: Counts = {}
    """Per producer incarnation: every group with seq below this is in the learner's last
    checkpoint, so the producer may forget it (it keeps the rest to resend after a restart)."""
    accepted: Counts = {}
    """Per producer incarnation: groups the learner has accepted so far (the producer's
    in-transit count is what it sent minus this)."""
    routes: Annotated[dict[Name, Literal["ipc", "nccl"]], Meta(max_length=65536)] = {}
    """Per producer id: the weight route to load ``version`` with; absent means the
    snapshot file (always written, also the fallback)."""
    transfer: dict[Name, Any] = {}
    """The GPU routes' payload as plain msgpack data (layout, IPC handle fields, NCCL link
    offers); only its types are checked here, ``sync.routes`` validates the meaning."""
    heading_to: Count = 0
    """The version the learner's training is heading to: ``version`` of its newest weights, plus
    one while it trains on a batch it has taken (a group started now is trained at this version
    or later, so producers on an older one wait rather than generate a group too stale)."""
    last_step: Count = 0
    """The run's final step (``train.steps``): with ``steps_taken``, the groups the run still
    trains on (``buffer.staleness.groups_to_go``), beyond which producers start none; 0: not
    told, no limit."""
    steps_taken: Count = 0
    """Batches the learner has taken: its steps done, plus the one it trains on now (those
    groups have left the buffer, so ``consumed`` counts them)."""
    members: Annotated[list[Name], Meta(max_length=4096)] = []
    """The producers of the run now, by id in index order: each producer's admission share and
    data shard are its rank among them (``num_producers`` ids from the start; elastic runs
    add the ones that join and drop the ones that leave)."""
    leases: Annotated[dict[Name, Annotated[list[Count], Meta(max_length=65536)]],
                      Meta(max_length=4096)] = {}
    """Per producer id, the ranges of the run's prompt sequence it may read, in order, as
    ``[base, start, end, start, end, ...]`` (``pipeline.learner.roster``): each position is
    leased to one producer, so every prompt is read once per epoch."""
    finished: bool = False
    """The learner has trained its last step and is stopping: producers exit (a learner that
    stops early, e.g. Ctrl-C or a crash, never sets it, so producers wait for its return)."""

    def __post_init__(self) -> None:
        _plain(self.transfer, "announce.transfer")


ControlMessage = Hello | Heartbeat | Ack | SyncReady | EvalResult | Leave
"""What producers send on the control channel."""
Message = ControlMessage | Welcome | Reply | Announce


# ---- frames ---------------------------------------------------------------------------------
class ProtocolError(ValueError):
    """Any invalid control frame; the message says what was wrong."""


class _Frame(Struct, forbid_unknown_fields=True):
    protocol: int
    rid: Count
    msg: msgspec.Raw


_encoder = msgspec.msgpack.Encoder()
_frame_decoder = msgspec.msgpack.Decoder(_Frame)
_msg_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message, rid: int = 0) -> bytes:
    """One frame holding ``msg``. Raises ValueError if ``msg`` breaks its declaration."""
    if not isinstance(msg, _Message):
        raise TypeError(f"cannot encode {type(msg).__name__}: not a protocol message")
    try:
        body = _encoder.encode(msg)
        _msg_decoder.decode(body)  # the declaration's checks, at the sender
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError, ValueError) as e:
        raise ValueError(f"invalid {type(msg).__name__}: {e}") from None
    return _encoder.encode(_Frame(PROTOCOL_VERSION, rid, msgspec.Raw(body)))


def decode(frame: bytes, max_bytes: int = MAX_CONTROL_BYTES) -> tuple[int, Message]:
    """``(rid, message)`` of one frame. Raises ProtocolError (and nothing else) if invalid."""
    try:
        if len(frame) > max_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {max_bytes}")
        outer = _frame_decoder.decode(frame)
        if outer.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {outer.protocol} is not supported (this build "
                f"speaks {PROTOCOL_VERSION})"
            )
        return outer.rid, _msg_decoder.decode(outer.msg)
    except ProtocolError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(str(e)) from None
    except Exception as e:  # malformed input never escapes as another exception type
        raise ProtocolError(f"invalid frame: {type(e).__name__}: {e}") from None
