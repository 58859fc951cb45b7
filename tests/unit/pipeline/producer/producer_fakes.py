"""Fakes shared by the producer's control-logic tests (named so: no sockets, no engine)."""

from __future__ import annotations

import numpy as np

from buffer.protocol import Hello, Reply, Welcome
from buffer.schema import Completion
from pipeline.config import load_config
from pipeline.producer.loop import Producer
from pipeline.producer.rewards.runner import RewardSet


class RecordingEndpoint:
    """Records control requests and answers them as a learner that knows us would."""

    def __init__(self):
        self.sent: list = []

    async def call(self, msg, timeout: float):
        self.sent.append(msg)
        if isinstance(msg, Hello):
            return Welcome(
                producer_id=msg.producer_id, incarnation=msg.incarnation, learner_session="s"
            )
        return Reply(ok=True)

    async def send(self, group, timeout: float | None = None) -> None:
        self.sent.append(group)


class Cursor:
    cursor = 0


class CharTokenizer:
    """One token per character (ord): enough for episode contexts and prompt rendering."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self.encode(text)}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def completion_fake(n: int) -> tuple[Completion, str]:
    """What the engine request returns for a completion of ``n`` tokens 'a' (``length_reward``
    scores it by its length)."""
    comp = Completion(np.full(n, 97, np.int32), np.full(n, -0.5, np.float32), [(0, 0)],
                      finish_reason="stop")
    return comp, "a" * n


def producer_fake_engine(tmp_path, endpoint=None, **overrides) -> Producer:
    """A real ``Producer`` (its ``GroupRollout``, a real ``RewardSet`` of ``length_reward``, the
    sent log in ``tmp_path``) without an engine: the test sets ``p.rollout._generate_one``."""
    cfg = load_config(overrides={
        "run_dir": str(tmp_path), "generation.group_size": 3,
        "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward"}], **overrides})
    p = Producer(cfg, 0, None, None, endpoint or RecordingEndpoint(),
                 RewardSet(cfg.rewards.specs), None)
    p.rollout._sampling = lambda **over: over
    return p
