"""The learner's roster: who is in the run (members, and who of them is leaving) and which part
of the prompt sequence each producer may read (its leases). Kept in ``run_dir/roster.json``,
written (fsynced, renamed) before any announce can name a change, so a restarted learner knows
exactly what the one before it told the producers, whichever checkpoint it restores.

Why a file of its own and not the checkpoint: a checkpoint is older than the run's present. A
producer that left after it must not be a member again (its share of the admission budget would
wait for it for good), and leases granted after it are held by live producers: granting them
again would have two producers read the same prompts.

Invariants (the property test in tests/unit/pipeline/learner/test_roster.py checks them over
random joins, leaves and restarts):
- every position of the prompt sequence (``pipeline.producer.data.PromptSource``) is leased to
  at most one producer at a time; a lease is only appended to, so a producer's cursor (positions
  read over its leases since the run began) means the same thing to both sides forever;
- what a producer that leaves did not read (from the exact cursor of its Leave) goes back to the
  pool and is leased to members before any new position, so nothing is skipped;
- a producer that died while leaving (said so, then fell silent) is taken out like one that
  left, from the learner's cursor of it;
- a new launch (``--resume``) starts with the producers it starts (``relaunch``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.learner.producers import Members

ROSTER_FILE = "roster.json"


@dataclass
class Lease:
    """One producer's leases: ``ranges`` [start, end) of the prompt sequence, read in order,
    after the ``base`` positions of leases already dropped as read."""

    base: int = 0
    ranges: list[list[int]] = field(default_factory=list)

    def unread(self, cursor: int) -> int:
        return sum(b - a for a, b in self.ranges) - max(cursor - self.base, 0)

    def drop_read(self, cursor: int) -> None:
        """Drop the leading ranges read entirely (``cursor``: a count the producer has reached)."""
        while self.ranges and cursor - self.base >= self.ranges[0][1] - self.ranges[0][0]:
            a, b = self.ranges.pop(0)
            self.base += b - a

    def take_back(self, cursor: int) -> list[list[int]]:
        """The positions not read by ``cursor``, removed from the lease (base becomes cursor)."""
        self.drop_read(cursor)
        rest, k = [], max(cursor - self.base, 0)
        for a, b in self.ranges:
            if a + k < b:
                rest.append([a + k, b])
            k = max(k - (b - a), 0)
        self.base, self.ranges = max(cursor, self.base), []
        return rest

    def wire(self) -> list[int]:
        """``Announce.leases`` form: [base, start, end, start, end, ...]
        (``PromptSource.lease_from`` reads it)."""
        return [self.base, *(x for r in self.ranges for x in r)]


class Roster:
    def __init__(self, num_producers: int, chunk: int, path: Path | None = None) -> None:
        """``chunk``: positions granted at a time, and the unread positions a member is kept
        above (a producer never waits for a lease while the learner keeps up)."""
        self.members = Members(num_producers)
        self.leaving: set[str] = set()
        self.leases: dict[str, Lease] = {}
        self.pool: list[list[int]] = []  # positions handed back, leased before new ones
        self.next_free = 0  # every position from here on was never leased
        self.chunk = max(1, chunk)
        self.path = path
        self.dirty = True

    # ------------------------------------------------------------------ members
    def join(self, producer_id: str, leaving: bool = False) -> bool:
        """A Hello from ``producer_id``; True if it became a member. One that is leaving (it
        said Hello to a restarted learner while it waits for its checkpoint) is never added."""
        if leaving:
            self.mark_leaving(producer_id)
            return False
        new = self.members.join(producer_id)
        self.dirty |= new
        return new

    def mark_leaving(self, producer_id: str) -> None:
        if producer_id in self.members and producer_id not in self.leaving:
            self.leaving.add(producer_id)
            self.dirty = True

    def leave(self, producer_id: str, cursor: int) -> bool:
        """``producer_id`` is out of the run, having read ``cursor`` positions of its leases;
        the rest go back to the pool. True if it was a member."""
        was = self.members.leave(producer_id)
        self.leaving.discard(producer_id)
        lease = self.leases.get(producer_id)
        if lease is not None:
            self.pool = _merge(self.pool + lease.take_back(cursor))
        self.dirty = True
        return was

    # ------------------------------------------------------------------ leases
    def top_up(self, delivered: dict[str, int], read: dict[str, int] | None = None) -> None:
        """Give every member not leaving a ``chunk`` more whenever fewer than ``chunk`` of its
        leased positions are unread; pooled positions first. ``delivered``: each producer's
        cursor as of the groups received (a restarted producer resumes there, so only what
        lies below it is dropped as read); ``read``: the cursor its heartbeat reported, ahead
        by the groups it has in flight (a better guess of what it still has to read)."""
        read = read or {}
        for pid in self.members:
            lease = self.leases.setdefault(pid, Lease())
            cursor = delivered.get(pid, 0)
            before = lease.base
            lease.drop_read(cursor)
            self.dirty |= lease.base != before
            if pid in self.leaving or \
                    lease.unread(max(cursor, read.get(pid, 0))) >= self.chunk:
                continue
            lease.ranges.extend(self._grant(self.chunk))
            self.dirty = True

    def _grant(self, n: int) -> list[list[int]]:
        out = []
        while n and self.pool:
            a, b = self.pool[0]
            take = min(n, b - a)
            out.append([a, a + take])
            n -= take
            if a + take == b:
                self.pool.pop(0)
            else:
                self.pool[0] = [a + take, b]
        if n:
            out.append([self.next_free, self.next_free + n])
            self.next_free += n
        return out

    def wire(self) -> dict[str, list[int]]:
        """``Announce.leases``: every producer that holds or held a lease."""
        return {pid: lease.wire() for pid, lease in self.leases.items()}

    # ------------------------------------------------------------------ file
    def to_dict(self) -> dict[str, Any]:
        return {"members": list(self.members), "leaving": sorted(self.leaving),
                "leases": {p: {"base": x.base, "ranges": x.ranges} for p, x in self.leases.items()},
                "pool": self.pool, "next_free": self.next_free}

    @classmethod
    def from_dict(cls, d: dict[str, Any], chunk: int, path: Path | None = None) -> Roster:
        r = cls(0, chunk, path)
        for pid in d.get("members", []):
            r.members.join(str(pid))
        r.leaving = {str(p) for p in d.get("leaving", []) if p in r.members}
        r.leases = {str(p): Lease(int(x["base"]), [[int(a), int(b)] for a, b in x["ranges"]])
                    for p, x in d.get("leases", {}).items()}
        r.pool = [[int(a), int(b)] for a, b in d.get("pool", [])]
        r.next_free = int(d.get("next_free", 0))
        r.dirty = False
        return r

    @classmethod
    def open(cls, run_dir: Path, num_producers: int, chunk: int) -> Roster:
        """The run's roster: the one on file (a restarted learner), else a new one."""
        path = Path(run_dir) / ROSTER_FILE
        try:
            return cls.from_dict(json.loads(path.read_text()), chunk, path)
        except FileNotFoundError:
            return cls(num_producers, chunk, path)

    def save(self) -> bool:
        """Write the roster if it changed (before an announce names the change); True if so."""
        if not self.dirty or self.path is None:
            return False
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as fh:
            json.dump(self.to_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self.dirty = False
        return True


def relaunch(run_dir: Path, num_producers: int, cursors: dict[str, int] | None = None) -> None:
    """A new launch of a run (``--resume``) starts with p0 .. p<num_producers - 1> only: the
    others' unread leases (from ``cursors``, by default the last checkpoint's) go back to the
    pool. The launcher calls it before the learner starts; a learner it restarts keeps the
    roster as it is."""
    path = Path(run_dir) / ROSTER_FILE
    if not path.exists():
        return
    if cursors is None:
        from pipeline.learner.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(run_dir)
        state = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else {}
        cursors = {str(k): int(v) for k, v in (state.get("cursors") or {}).items()}
    try:
        roster = Roster.from_dict(json.loads(path.read_text()), 1, path)
    except FileNotFoundError:
        return
    starting = {f"p{i}" for i in range(num_producers)}
    for pid in list(roster.members):
        if pid not in starting:
            roster.leave(pid, cursors.get(pid, 0))
    roster.leaving.clear()
    for pid in sorted(starting):
        roster.members.join(pid)
    roster.dirty = True
    roster.save()


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out
