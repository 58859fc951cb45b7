"""Producer._apply_announce across a learner restart (pure control logic: the engine is absent
and the endpoint and prompt source are fakes that record what the producer does)."""

from __future__ import annotations

import asyncio

from producer_fakes import Cursor, RecordingEndpoint

from buffer.protocol import Announce, Hello, SyncReady
from pipeline.config import load_config
from pipeline.producer.loop import Producer


def _announce(session: str) -> Announce:
    # No snapshot: only the session bookkeeping runs (no swap, no engine).
    return Announce(version=0, snapshot_uri="", snapshot_checksum="", learner_session=session,
                    received={}, consumed={})


def test_restarted_learner_gets_a_new_hello_with_our_gpus_fake_endpoint(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    endpoint = RecordingEndpoint()
    producer = Producer(cfg, 0, None, None, endpoint, None, Cursor())
    producer.weights.devices = ["GPU-uuid-0"]

    async def run() -> None:
        await producer._apply_announce(_announce("first"))   # first contact: Hello came at start
        await producer._apply_announce(_announce("first"))
        assert not [m for m in endpoint.sent if isinstance(m, Hello)]
        await producer._apply_announce(_announce("second"))  # the learner restarted
        hellos = [m for m in endpoint.sent if isinstance(m, Hello)]
        assert len(hellos) == 1 and hellos[0].devices == ["GPU-uuid-0"]

    asyncio.run(run())


class FailingJoinEngine:
    """collective_rpc fails the worker's NCCL join (as a learner that never joins would)."""

    async def collective_rpc(self, method: str, args: tuple = ()):
        raise RuntimeError(f"fake {method} failed")


def test_failed_nccl_join_tells_the_learner_to_drop_the_link_fake_engine(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    endpoint = RecordingEndpoint()
    producer = Producer(cfg, 0, FailingJoinEngine(), None, endpoint, None, Cursor())
    offer = {"epoch": 5, "unique_id": b"u" * 128, "world_size": 2, "rank_offset": 1}
    ann = Announce(version=0, snapshot_uri="", snapshot_checksum="", learner_session="s",
                   received={}, consumed={}, routes={"p0": "nccl"},
                   transfer={"layout": [], "nccl": {"p0": offer}})
    asyncio.run(producer._apply_announce(ann))
    ready = [(m.purpose, m.epoch) for m in endpoint.sent if isinstance(m, SyncReady)]
    assert ready == [("link", 5), ("drop", 5)]
    assert producer.weights.routes["nccl"].link is None


def test_a_restarted_producer_does_not_read_again_what_its_predecessor_sent(tmp_path):
    """A killed predecessor's outbox log is resent to the learner: its prompts (the same
    leases, so the same cursor unit) are not read a second time, even before the learner has
    counted them in its cursors."""
    from types import SimpleNamespace

    from pipeline.config import DataConfig
    from pipeline.producer.data import PromptSource

    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    prompts = PromptSource(DataConfig(path="arithmetic:12"))
    producer = Producer(cfg, 0, None, None, RecordingEndpoint(), None, prompts)
    producer.outbox.pending[("p0-dead", 4)] = SimpleNamespace(metadata={"cursor": 5, "seq": 4})

    async def run() -> None:
        ann = _announce("first")
        ann.cursors = {"p0": 3}  # the learner's checkpoint had the groups up to cursor 3
        ann.leases = {"p0": [0, 0, 8]}
        await producer._apply_announce(ann)

    asyncio.run(run())
    assert prompts.cursor == 5 and prompts.take().position == 5


def test_a_restarted_learners_version_under_the_number_we_run_is_loaded_fake_engine(tmp_path):
    """The producer runs v5 of a learner since restarted from an older checkpoint; the first
    announce it hears of the new learner is its v5 (trained anew meanwhile, while the producer
    was busy): it loads it, rather than generate on the old weights tagged as the new v5."""
    from sync.barrier import SwapReport

    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    producer = Producer(cfg, 0, None, None, RecordingEndpoint(), None, Cursor())
    loads: list[str] = []

    async def load(ref, route="file", transfer=None):
        loads.append(ref.uri)
        producer.weights.tracker.version = ref.version
        return SwapReport(ref.version, True)

    producer.weights.load = load

    def announce(session: str) -> Announce:
        return Announce(version=5, snapshot_uri=f"/snaps/{session}/v5.safetensors",
                        snapshot_checksum="c", learner_session=session, received={},
                        consumed={})

    async def run() -> None:
        await producer._apply_announce(announce("first"))
        await producer._apply_announce(announce("first"))  # held: not loaded again
        await producer._apply_announce(announce("second"))

    asyncio.run(run())
    assert loads == ["/snaps/first/v5.safetensors", "/snaps/second/v5.safetensors"]
