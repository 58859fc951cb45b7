"""The learner's rollout buffer: pure bookkeeping of whole groups, no sockets.

Owns admission (capacity), staleness enforcement at consume time (the rule itself is
``buffer.staleness``), ordering, and the counters reported to the user. Invariants, after
every public call:

- ``received == served + dropped_stale + dropped_capacity + rejected_groups + len(buffer)``
  where ``rejected_groups`` is the total over reasons of groups that decoded but failed the
  run's checks (``buffer.checks``); ``rejected`` counts frames that never decoded into a group,
  so it is outside this sum;
- groups are stored, dropped and served whole, never split;
- no group is served with ``learner_version - policy_version > max_staleness``.

Not thread-safe: call it from the event loop thread only (the receiver and the learner loop are
coroutines on the same loop). Waiters are futures created lazily in the running loop, so the
buffer holds no global or loop-bound state until someone awaits.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

import msgpack

from buffer.checks import Rejection
from buffer.schema import DecodeError, RolloutGroup, decode, encode
from buffer.staleness import is_trainable

Order = Literal["fifo", "freshest"]
_SNAPSHOT_FORMAT = 2  # carries rejected_groups; format 1 (without them) still loads


@dataclass
class BufferStats:
    """Counters since the buffer was created (or restored)."""

    received: int = 0
    """Groups offered to put()."""
    rejected: int = 0
    """Frames that failed to decode (never became groups)."""
    rejected_groups: dict[str, int] = field(default_factory=dict)
    """Groups that decoded but failed the run's checks, per reason (``buffer.checks``)."""
    dropped_stale: int = 0
    """Groups dropped because they exceeded max_staleness."""
    dropped_capacity: int = 0
    """Groups dropped because the buffer was full."""
    served: int = 0
    """Groups handed to the learner."""
    size: int = 0
    """Groups held now."""
    age_histogram: dict[int, int] = field(default_factory=dict)
    """Staleness (learner_version - policy_version) at serve time -> number of groups."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class RolloutBuffer:
    """Bounded store of rollout groups with staleness limits.

    ``order="fifo"`` serves groups in arrival order; ``"freshest"`` serves the highest
    policy_version first (ties: newest arrival first). When full, ``put`` evicts the group with
    the oldest policy_version (the one closest to going stale; ties: oldest arrival) unless the
    incoming group is older still, in which case the incoming group is dropped. Either way one
    group is counted in ``dropped_capacity``.
    """

    def __init__(self, capacity: int, max_staleness: int | None, order: Order = "fifo"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if order not in ("fifo", "freshest"):
            raise ValueError(f"order must be 'fifo' or 'freshest', got {order!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.order: Order = order
        # Arrival sequence number -> (policy_version, group); dict order is arrival order.
        # The version is cached because RolloutGroup.policy_version scans every completion.
        self._groups: dict[int, tuple[int, RolloutGroup]] = {}
        self._seq = 0
        self._received = 0
        self._rejected = 0
        self._dropped_stale = 0
        self._dropped_capacity = 0
        self._served = 0
        self._rejected_groups: Counter[str] = Counter()
        self._ages: Counter[int] = Counter()
        self._data_waiters: list[asyncio.Future[None]] = []
        self._space_waiters: list[asyncio.Future[None]] = []

    # ---- core operations -------------------------------------------------------------------

    def put(self, group: RolloutGroup) -> bool:
        """Store ``group``; returns False if it was dropped instead (buffer full of fresher
        groups). Every call counts in ``received``."""
        version = group.policy_version  # raises on a group without completions
        self._received += 1
        stored = True
        if len(self._groups) >= self.capacity:
            victim = min(self._groups, key=lambda s: (self._groups[s][0], s))
            self._dropped_capacity += 1
            if self._groups[victim][0] <= version:
                del self._groups[victim]
            else:
                stored = False
        if stored:
            self._groups[self._seq] = (version, group)
            self._seq += 1
            self._wake(self._data_waiters)
        return stored

    def space(self) -> int:
        """Groups that can be stored before put() has to evict."""
        return self.capacity - len(self._groups)

    def drop_stale(self, learner_version: int) -> int:
        """Drop (and count) every group older than max_staleness; returns how many."""
        if self.max_staleness is None:
            return 0
        stale = [s for s, (v, _) in self._groups.items()
                 if not is_trainable(v, learner_version, self.max_staleness)]
        for s in stale:
            del self._groups[s]
        if stale:
            self._dropped_stale += len(stale)
            self._wake(self._space_waiters)
        return len(stale)

    def take(self, n_groups: int, learner_version: int) -> list[RolloutGroup] | None:
        """Drop stale groups, then remove and return exactly ``n_groups`` whole groups in the
        buffer's order, or None (removing nothing more) if fewer are left."""
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        self.drop_stale(learner_version)
        if len(self._groups) < n_groups:
            return None
        if self.order == "fifo":
            keys = list(self._groups)[:n_groups]  # dict order = arrival order
        else:
            keys = sorted(self._groups, key=lambda s: (self._groups[s][0], s), reverse=True)[
                :n_groups
            ]
        batch = []
        for s in keys:
            version, group = self._groups.pop(s)
            self._ages[learner_version - version] += 1
            batch.append(group)
        self._served += n_groups
        self._wake(self._space_waiters)
        return batch

    def note_rejected(self, n: int = 1) -> None:
        """Count frames that failed to decode (reported in stats, outside the group sum)."""
        self._rejected += n

    def reject(self, group: RolloutGroup, reason: str) -> None:
        """Count a group offered to the buffer that failed the run's checks: it is received
        (inside the group sum) and never stored or served."""
        self._received += 1
        self._rejected_groups[reason] += 1

    def recheck(self, check: Callable[[RolloutGroup], Rejection | None]
                ) -> list[tuple[RolloutGroup, Rejection]]:
        """Remove every held group that ``check`` rejects (a resumed buffer is checked against
        the run again); each is counted as rejected. Returns them with their rejections."""
        out = []
        for s, (_v, g) in list(self._groups.items()):
            bad = check(g)
            if bad is not None:
                del self._groups[s]
                self._rejected_groups[bad.reason] += 1
                out.append((g, bad))
        if out:
            self._wake(self._space_waiters)
        return out

    # ---- async waiting ---------------------------------------------------------------------

    async def get_batch(
        self, n_groups: int, learner_version: int, timeout: float | None
    ) -> list[RolloutGroup]:
        """Wait until ``n_groups`` fresh-enough groups are available and take them.

        Raises TimeoutError (with the buffer's state in the message) after ``timeout`` seconds.
        """
        if n_groups > self.capacity:
            raise ValueError(
                f"get_batch({n_groups}) can never be satisfied by a buffer of capacity "
                f"{self.capacity}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.take(n_groups, learner_version)
            if batch is not None:
                return batch
            try:
                await self._wait(self._data_waiters, deadline)
            except TimeoutError:
                raise TimeoutError(
                    f"RolloutBuffer.get_batch: timed out after {timeout:.3g} s waiting for "
                    f"{n_groups} groups at learner_version={learner_version} "
                    f"(max_staleness={self.max_staleness}): {len(self)} held, "
                    f"{self._received} received, {self._dropped_stale} dropped as stale, "
                    f"{self._rejected} frames rejected. Are producers running and connected?"
                ) from None

    async def wait_for_space(self, timeout: float | None = None) -> None:
        """Return once put() can store a group without evicting (receiver back-pressure)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.space() <= 0:
            try:
                await self._wait(self._space_waiters, deadline)
            except TimeoutError:
                raise TimeoutError(
                    f"RolloutBuffer.wait_for_space: still full ({len(self)}/{self.capacity} "
                    f"groups) after {timeout:.3g} s; is the learner consuming?"
                ) from None

    async def _wait(self, waiters: list[asyncio.Future[None]], deadline: float | None) -> None:
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            if deadline is None:
                await fut
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    await fut
        finally:
            if fut in waiters:
                waiters.remove(fut)

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        waiters.clear()

    # ---- persistence -----------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Contents and counters as bytes (each group in the wire format), for checkpoints."""
        return msgpack.packb(
            {
                "format": _SNAPSHOT_FORMAT,
                "counters": [
                    self._received,
                    self._rejected,
                    self._dropped_stale,
                    self._dropped_capacity,
                    self._served,
                ],
                "ages": [[k, v] for k, v in sorted(self._ages.items())],
                "rejected_groups": dict(sorted(self._rejected_groups.items())),
                "groups": [encode(g) for _, g in self._groups.values()],
            }
        )

    @classmethod
    def restore(
        cls, data: bytes, capacity: int, max_staleness: int | None, order: Order = "fifo"
    ) -> RolloutBuffer:
        """Rebuild a buffer from snapshot(). Groups beyond ``capacity`` are evicted as by put()
        and counted in dropped_capacity. Raises DecodeError on a corrupt snapshot."""
        buf = cls(capacity, max_staleness, order)
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
            if obj.get("format") not in (1, _SNAPSHOT_FORMAT):
                raise DecodeError(f"unsupported buffer snapshot format {obj.get('format')!r}")
            counters = [int(x) for x in obj["counters"]]
            ages = {int(k): int(v) for k, v in obj["ages"]}
            rejected_groups = {str(k): int(v) for k, v in obj.get("rejected_groups", {}).items()}
            groups = [decode(f) for f in obj["groups"]]
        except DecodeError:
            raise
        except Exception as e:
            raise DecodeError(f"corrupt buffer snapshot: {type(e).__name__}: {e}") from None
        if not all(isinstance(g, RolloutGroup) for g in groups):
            raise DecodeError("corrupt buffer snapshot: non-group message among groups")
        received, buf._rejected, buf._dropped_stale, buf._dropped_capacity, buf._served = (
            counters
        )
        buf._ages = Counter(ages)
        buf._rejected_groups = Counter(rejected_groups)
        for g in groups:
            buf.put(g)  # counts each in received; replaced by the saved total below
        buf._received = received
        return buf

    # ---- introspection ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def stats(self) -> BufferStats:
        return BufferStats(
            received=self._received,
            rejected=self._rejected,
            rejected_groups=dict(sorted(self._rejected_groups.items())),
            dropped_stale=self._dropped_stale,
            dropped_capacity=self._dropped_capacity,
            served=self._served,
            size=len(self._groups),
            age_histogram=dict(sorted(self._ages.items())),
        )

    def held_by_producer(self) -> dict[str, int]:
        """Groups held now, per producer_id (admission control uses this)."""
        return dict(Counter(g.producer_id for _, g in self._groups.values()))
