"""Waiting in async tests for what another thread or task does: the event, within a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def settle(pred: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Return once ``pred()`` holds; fail naming ``what`` after ``timeout`` s (a bound for a
    machine busy with other tests, not an expected time: it normally holds in milliseconds)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
