"""Fakes shared by the producer's control-logic tests (named so: no sockets, no engine)."""

from __future__ import annotations

from buffer.protocol import Hello, Reply, Welcome


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
