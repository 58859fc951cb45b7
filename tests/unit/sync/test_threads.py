"""``sync.threads.in_daemon_thread``: blocking calls that may never return (a NCCL join, a reward
or episode tool), awaited without holding the process."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sync.threads import in_daemon_thread
from tests.waiting import settle


def test_in_daemon_thread_result_error_and_orphan():
    orphans: list = []

    async def main():
        assert await in_daemon_thread(lambda x: x + 1, 1) == 2
        with pytest.raises(ValueError):
            await in_daemon_thread(_raise, ValueError("boom"))
        gate = threading.Event()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(in_daemon_thread(lambda: gate.wait(5) and "late comm",
                                                    on_orphan=orphans.append), 0.05)
        gate.set()
        await settle(lambda: orphans, "the late result reaches on_orphan")

    asyncio.run(main())
    assert orphans == ["late comm"]
    threads = [t for t in threading.enumerate() if t.name.startswith("daemon-")]
    assert all(t.daemon for t in threads)


def _raise(e):
    raise e
