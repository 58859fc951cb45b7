"""What the learner knows of each producer (from its Hello and heartbeats), and when one counts
as alive: heard from within ``ALIVE_S``. A producer not alive gets no GPU copy of a version and
no NCCL link kept up, and training does not wait for its ack."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

ALIVE_S = 10.0  # a producer silent for longer is reported as not alive


@dataclass
class ProducerInfo:
    pid: int = 0
    version: int = 0
    last_seen: float = -ALIVE_S  # not alive until heard from after its Hello
    stats: dict[str, float] = field(default_factory=dict)  # its last heartbeat's
    carried: dict[str, float] = field(default_factory=dict)  # its earlier processes' counters
    devices: list[str] = field(default_factory=list)  # GPU UUID per vLLM worker ([] = CPU)
    route: str = "file"  # weight route for this producer (sync.routes)

    def alive(self, now: float) -> bool:
        return now - self.last_seen < ALIVE_S


class Members:
    """The producers of the run now, in index order: each one's admission share and data shard
    is its rank among them (``Announce.members``). A run starts with p0 .. p<num_producers - 1>
    (members before they say Hello, so a batch waits for a producer that is still starting);
    in an elastic run (``max_producers``) a producer joins with its Hello and leaves with its
    Leave. A restarted producer keeps its place."""

    def __init__(self, num_producers: int) -> None:
        self._ids = {f"p{i}" for i in range(num_producers)}

    def join(self, producer_id: str) -> bool:
        """Add ``producer_id``; True if it was not a member."""
        new = producer_id not in self._ids
        self._ids.add(producer_id)
        return new

    def leave(self, producer_id: str) -> bool:
        """Take ``producer_id`` out; True if it was a member."""
        was = producer_id in self._ids
        self._ids.discard(producer_id)
        return was

    def __contains__(self, producer_id: object) -> bool:
        return producer_id in self._ids

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._ids, key=lambda p: int(p[1:])))

    def __len__(self) -> int:
        return len(self._ids)

    def __str__(self) -> str:
        return f"{len(self)} producer{'s' if len(self) != 1 else ''} ({', '.join(self)})"
