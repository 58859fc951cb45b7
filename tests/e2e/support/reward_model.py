"""A small CPU "reward model" for the ``executor: ray`` end-to-end test (loaded by file path in
each replica): its weights are read from a JSON file when the replica builds it, and each score
takes ``delay_s``, like a model's forward pass. While it scores it marks itself busy
(``marker_dir/<pid>.busy``), so the test can kill a replica in the middle of a call."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class TinyRewardModel:
    """Score = mean over the completion's characters of a per-class weight (digit, space,
    other): deterministic, finite, and in [0, 1] for weights in [0, 1]."""

    def __init__(self, weights_path: str, marker_dir: str, delay_s: float = 0.2):
        self.weights = json.loads(Path(weights_path).read_text())
        self.marker = Path(marker_dir) / f"{os.getpid()}.busy"
        self.seen = Path(marker_dir) / f"{os.getpid()}.pid"
        self.seen.touch()
        self.delay_s = delay_s

    def _char(self, ch: str) -> float:
        kind = "digit" if ch.isdigit() else "space" if ch.isspace() else "other"
        return float(self.weights[kind])

    def __call__(self, prompt: str, completion: str) -> float:
        self.marker.touch()
        try:
            time.sleep(self.delay_s)
            if not completion:
                return 0.0
            return sum(self._char(c) for c in completion) / len(completion)
        finally:
            self.marker.unlink(missing_ok=True)
