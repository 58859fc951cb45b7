"""Rewards for the end-to-end test of dynamic sampling (imported by the producer by name)."""

from __future__ import annotations

import zlib


def half_constant(prompt: str, completion: str, prompt_id: str = "", **meta) -> float:
    """1.0 whatever the completion for about half the prompts (chosen by the prompt id's
    crc32, so a run's uninformative groups are known from its prompts), else a number in [0, 1)
    drawn from the completion's text (its crc32), which differs between sampled completions."""
    if zlib.crc32(str(prompt_id).encode()) % 2 == 0:
        return 1.0
    return (zlib.crc32(completion.encode()) % 1000) / 1000
