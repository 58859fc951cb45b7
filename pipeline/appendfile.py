"""Files a run appends whole records to (a producer's outbox and sent logs, the learner's
metrics.jsonl), written so that a full disk is a wait, never a torn record or a crash.

Invariants: the file holds whole records only. A record is written with unbuffered writes; if
the disk refuses part of it (``is_disk_full``), the file is cut back to where the record began
and ``DiskFull`` is raised: nothing of it stays, and the caller decides whether the record waits
(``AppendFile.waiting`` keeps it, in order, for the next ``append`` or ``retry``) or is given up.
One process appends to each such file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk (or the user's quota on it) has no room left."""
    return isinstance(e, OSError) and e.errno in FULL_ERRNOS


def write_all(fd: int, data: bytes) -> tuple[int, OSError | None]:
    """Write ``data`` to ``fd`` to its end: (0, None), or on a full disk the bytes it left
    unwritten and the error that stopped it. Any other OSError is raised."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if not is_disk_full(e):
            raise
        return len(view), e
    return 0, None


class DiskFull(OSError):
    """A record the disk had no room for: none of it is in the file."""


class AppendFile:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.waiting: list[bytes] = []  # records the disk had no room for, oldest first

    def write(self, record: bytes) -> None:
        """Append ``record`` whole, or raise ``DiskFull`` with none of it in the file."""
        start = os.fstat(self._fd).st_size
        left, e = write_all(self._fd, record)
        if e is not None:
            if left < len(record):
                os.ftruncate(self._fd, start)  # shrinking a file needs no room
            raise DiskFull(e.errno, f"{self.path}: {e.strerror}")

    def append(self, record: bytes) -> bool:
        """Append ``record`` after any that wait; on a full disk it waits too (kept in order
        for the next call or ``retry``). True if every record is in the file now."""
        self.waiting.append(record)
        return self.retry()

    def retry(self) -> bool:
        """Write the records that wait, oldest first; True once none waits."""
        while self.waiting:
            try:
                self.write(self.waiting[0])
            except DiskFull:
                return False
            self.waiting.pop(0)
        return True

    def tell(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        """Close the file (records still waiting are given up: the caller retried them)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
