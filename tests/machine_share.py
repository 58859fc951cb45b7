"""End-to-end tests share the machine; a test marked ``exclusive`` runs alone.

Why: ``scripts/test.sh`` runs two tests at once (pytest-xdist), and a few tests change what
every run on the machine sees (a launcher killed with everything it started leaves /dev/shm
segments that the next run on the machine reclaims, and that other tests count as leaked). Every
end-to-end test holds a shared lock on one file for its whole time; an ``exclusive`` test holds it
alone. The file is machine-wide, so a second suite on the same machine waits as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "pipeline-grpo-e2e.lock"


def holds_machine(nodeid: str) -> bool:
    """End-to-end tests hold the machine (shared, or alone if ``exclusive``); unit tests do not."""
    return nodeid.startswith("tests/e2e/")


@contextlib.contextmanager
def hold(exclusive: bool, lock: Path = LOCK) -> Iterator[float]:
    """Holds ``lock`` (shared, or alone) until the block ends; yields the seconds waited for it."""
    with open(lock, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
