"""Rewards for end-to-end tests of failure accounting (imported by the producers by name)."""

from __future__ import annotations

import zlib


def flaky(prompt: str, completion: str, **meta) -> float:
    """Fails about 30% of calls, like a reward service answering 503: which ones is fixed by
    the completion's text (crc32), so a run's failure count is reproducible from its texts."""
    if zlib.crc32(f"{prompt}\0{completion}".encode()) % 10 < 3:
        raise RuntimeError("reward service unavailable (503)")
    return -float(abs(20 - len(completion)))
