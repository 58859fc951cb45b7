"""A producer's outbox: every group sent but not yet durable at the learner, in memory and on disk.

The learner announces, per producer incarnation, the seq below which every group is in its last
checkpoint (``Announce.durable``); the outbox forgets those. What is left is resent to a
restarted learner (which drops duplicates, see ``buffer.ledger``). The same groups are appended to
a log file (``<run_dir>/producers/<incarnation>.wal``, length-prefixed msgpack frames), so a
producer killed with groups still in its socket queue loses nothing either: the next producer with
the same id recovers the dead incarnation's log and resends it.

What is in these logs and not in the learner's ledger when a run ends (a producer restarted late,
whose successor was still starting when the learner finished; groups in flight at the end) is
what ``undelivered`` counts: ``--resume`` resends it.

A group is in the log before it is sent. When the disk has no room for it (``record``), it waits
in memory, none of it in the file (``pipeline.appendfile``), and is retried every
``DISK_RETRY_S``; meanwhile ``full`` is set and the producer admits no new group (one warning,
``DISK_FULL``, at most every ``DISK_WARN_EVERY_S``). The first group that goes in clears it:
generation resumes by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from pathlib import Path

from buffer.ledger import GroupLedger
from buffer.schema import DecodeError, RolloutGroup, decode, encode
from pipeline.appendfile import AppendFile, DiskFull, is_disk_full

log = logging.getLogger(__name__)
_LEN = struct.Struct("<I")
COMPACT_BYTES = 64 << 20  # rewrite our log once it is this big and mostly durable
DISK_RETRY_S = 1.0  # a group the disk had no room for is tried again this often
DISK_FULL = "run_dir's disk is full: generation paused; free space to continue"
DISK_WARN_EVERY_S = 600.0  # a pause within this long of the last one told is logged only


def read_log(path: Path) -> list[RolloutGroup]:
    """Groups in a log file; a torn last frame (killed mid-write) is ignored."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        frame = data[pos + _LEN.size: pos + _LEN.size + n]
        if len(frame) < n:
            break
        try:
            msg = decode(frame)
        except DecodeError as e:
            log.warning("%s: skipping an unreadable frame at byte %d: %s", path, pos, e)
        else:
            if isinstance(msg, RolloutGroup):
                out.append(msg)
        pos += _LEN.size + n
    return out


def _key(group: RolloutGroup) -> tuple[str, int]:
    return str(group.metadata["incarnation"]), int(group.metadata["seq"])


def undelivered(directory: Path, ledger: GroupLedger) -> dict[str, list[int]]:
    """The policy_version of each group in the outbox logs under ``directory`` that ``ledger``
    (the learner's, as of its last checkpoint) has not accepted, by log file name; files with
    none are left out. These are the groups a resumed run's producers resend."""
    out: dict[str, list[int]] = {}
    for path in sorted(Path(directory).glob("*.wal")):
        versions = []
        for g in read_log(path):
            inc, seq = _key(g)
            stream = ledger.streams.get(inc)
            if stream is None or not (seq < stream.prefix or seq in stream.above):
                versions.append(g.policy_version)
        if versions:
            out[path.name] = versions
    return out


class Outbox:
    def __init__(self, directory: Path, producer_id: str, incarnation: str, max_groups: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.incarnation = incarnation
        self.max_groups = max_groups
        self.pending: dict[tuple[str, int], RolloutGroup] = {}
        self.overflow = 0
        self.recovered = 0
        self._foreign: dict[str, Path] = {}  # dead incarnations' logs we took over
        for path in sorted(self.dir.glob(f"{producer_id}-*.wal")):
            inc = path.stem
            if inc == incarnation:
                continue
            groups = read_log(path)
            for g in groups:
                self.pending[_key(g)] = g
            self.recovered += len(groups)
            self._foreign[inc] = path
        if self.recovered:
            log.info("%s: recovered %d unconfirmed group(s) of earlier %s process(es)",
                     incarnation, self.recovered, producer_id)
        self._path = self.dir / f"{incarnation}.wal"
        self._log = AppendFile(self._path)
        self.producer_id = producer_id
        self.full = False  # a group waits for room on the disk: admit nothing new
        self.full_pauses = 0  # times the disk filled
        self._full_since = 0.0
        self._full_s = 0.0  # seconds of the pauses that ended
        self._warned_at = -DISK_WARN_EVERY_S  # when the last pause was told on the console

    @property
    def full_s(self) -> float:
        """Seconds the producer has waited for disk space, the wait under way included."""
        now = time.monotonic()
        return self._full_s + (now - self._full_since if self.full else 0.0)

    def add(self, group: RolloutGroup) -> None:
        """Log ``group`` (in the page cache: survives kill -9 of this process) and keep it until
        durable; ``DiskFull`` with none of it logged when the disk has no room."""
        frame = encode(group)
        self._log.write(_LEN.pack(len(frame)) + frame)
        self.pending[_key(group)] = group
        if len(self.pending) > self.max_groups:
            del self.pending[min(self.pending, key=lambda k: k[1])]
            self.overflow += 1

    async def record(self, group: RolloutGroup) -> None:
        """``add``, waiting while the disk has no room (``full``; the module docstring)."""
        while True:
            try:
                self.add(group)
                break
            except DiskFull:
                if not self.full:
                    self.full, self._full_since = True, time.monotonic()
                    self.full_pauses += 1
                    # One console line, not one per pause of a disk that hovers near full.
                    quiet = self._full_since - self._warned_at < DISK_WARN_EVERY_S
                    if not quiet:
                        self._warned_at = self._full_since
                    log.log(logging.INFO if quiet else logging.WARNING, "%s: %s",
                            self.producer_id, DISK_FULL)
                await asyncio.sleep(DISK_RETRY_S)
        if self.full:
            self.full = False
            paused = time.monotonic() - self._full_since
            self._full_s += paused
            log.info("%s: room on the disk again after %.0f s: generation resumes",
                     self.producer_id, paused)

    def forget_durable(self, durable: dict[str, int]) -> None:
        for key in [k for k in self.pending if k[1] < durable.get(k[0], 0)]:
            del self.pending[key]
        live = {inc for inc, _ in self.pending}
        for inc in [i for i in self._foreign if i not in live]:
            self._foreign.pop(inc).unlink(missing_ok=True)
        if self._log.tell() > COMPACT_BYTES and not self.full:
            self._compact()

    def _compact(self) -> None:
        """Rewrite our log with only the groups not yet durable; on a full disk the log stays
        as it is (compacted at a later announce)."""
        tmp = self._path.with_suffix(".tmp")
        try:
            with tmp.open("wb") as fh:
                for key in sorted(self.pending, key=lambda k: k[1]):
                    if key[0] == self.incarnation:
                        frame = encode(self.pending[key])
                        fh.write(_LEN.pack(len(frame)) + frame)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not is_disk_full(e):
                raise
            return
        self._log.close()
        os.replace(tmp, self._path)
        self._log = AppendFile(self._path)

    @property
    def incarnations_recovered(self) -> list[str]:
        """Incarnations of dead processes whose unconfirmed groups we resend."""
        return sorted(self._foreign)

    def unconfirmed(self) -> list[RolloutGroup]:
        return [self.pending[k] for k in sorted(self.pending)]

    def close(self) -> None:
        self._log.close()
