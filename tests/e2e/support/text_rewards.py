"""A reward that identifies a completion's text, for end-to-end tests that compare evaluations
(imported by the producers by name): two evaluations with equal ``eval/reward_mean`` generated
the same texts, all but surely."""

from __future__ import annotations

import zlib


def fingerprint(prompt: str, completion: str, **meta) -> float:
    """crc32 of the completion's text, scaled to [0, 1)."""
    return zlib.crc32(completion.encode()) / 2**32
