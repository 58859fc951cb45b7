"""Exactly-once admission of groups that may arrive more than once (pure logic, no sockets).

Every producer process (an *incarnation*: a producer id + OS pid + start time) numbers the groups
it sends 0, 1, 2, ...; it keeps each one until the learner says it is in a checkpoint, and after
a learner restart it resends what the restored learner lacks. So a group can arrive twice; the
ledger accepts each (incarnation, seq) once and counts the duplicates.

Invariant per stream: ``prefix`` = every seq below it was accepted; ``above`` = accepted seqs
beyond the first gap. The durable point announced to producers is the prefix as of the last
checkpoint, so a producer never forgets a group the learner could still lose.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamState:
    prefix: int = 0
    above: set[int] = field(default_factory=set)

    def accept(self, seq: int) -> bool:
        if seq < self.prefix or seq in self.above:
            return False
        self.above.add(seq)
        while self.prefix in self.above:
            self.above.discard(self.prefix)
            self.prefix += 1
        return True

    @property
    def accepted(self) -> int:
        return self.prefix + len(self.above)


@dataclass
class GroupLedger:
    streams: dict[str, StreamState] = field(default_factory=dict)
    duplicates: int = 0

    def accept(self, incarnation: str, seq: int) -> bool:
        """True the first time (incarnation, seq) is seen; False (and counted) after that."""
        ok = self.streams.setdefault(incarnation, StreamState()).accept(seq)
        if not ok:
            self.duplicates += 1
        return ok

    def prefixes(self) -> dict[str, int]:
        return {k: s.prefix for k, s in self.streams.items()}

    def accepted(self, incarnation: str) -> set[int]:
        s = self.streams.get(incarnation, StreamState())
        return set(range(s.prefix)) | s.above

    def to_dict(self) -> dict:
        return {"duplicates": self.duplicates,
                "streams": {k: [s.prefix, sorted(s.above)] for k, s in self.streams.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> GroupLedger:
        streams = {k: StreamState(prefix=int(p), above={int(x) for x in a})
                   for k, (p, a) in d.get("streams", {}).items()}
        return cls(streams=streams, duplicates=int(d.get("duplicates", 0)))
