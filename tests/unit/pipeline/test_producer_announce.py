"""Producer._apply_announce across a learner restart (pure control logic: the engine is absent
and the endpoint and prompt source are fakes that record what the producer does)."""

from __future__ import annotations

import asyncio

from buffer.schema import Announce, Hello
from pipeline.config import load_config
from pipeline.producer import Producer


class RecordingEndpoint:
    def __init__(self):
        self.sent: list = []

    async def send(self, msg) -> None:
        self.sent.append(msg)


class Cursor:
    cursor = 0


def _announce(session: str) -> Announce:
    # No snapshot: only the session bookkeeping runs (no swap, no engine).
    return Announce(version=0, snapshot_uri="", snapshot_checksum="", learner_session=session,
                    received={}, consumed={})


def test_restarted_learner_gets_a_new_hello_with_our_gpus_fake_endpoint(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    endpoint = RecordingEndpoint()
    producer = Producer(cfg, 0, None, None, endpoint, None, Cursor())
    producer.devices = ["GPU-uuid-0"]

    async def run() -> None:
        await producer._apply_announce(_announce("first"))   # first contact: Hello came at start
        await producer._apply_announce(_announce("first"))
        assert not [m for m in endpoint.sent if isinstance(m, Hello)]
        await producer._apply_announce(_announce("second"))  # the learner restarted
        hellos = [m for m in endpoint.sent if isinstance(m, Hello)]
        assert len(hellos) == 1 and hellos[0].devices == ["GPU-uuid-0"]

    asyncio.run(run())
