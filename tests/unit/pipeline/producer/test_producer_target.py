"""Producer._target and _apply_announce when GPU copies are announced before their files (pure
control logic: the weights' load is a fake that records versions; no engine)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from producer_fakes import Cursor, RecordingEndpoint

from buffer.protocol import Announce
from pipeline.config import load_config
from pipeline.producer.loop import Producer


def _ann(file_v: int, gpu_v: int | None, session: str = "s", route: str = "ipc") -> Announce:
    return Announce(version=file_v, snapshot_uri=f"/snap/v{file_v}" if file_v else "",
                    snapshot_checksum="blake3:x" if file_v else "", learner_session=session,
                    received={}, consumed={}, routes={"p0": route} if gpu_v else {},
                    transfer={"version": gpu_v, "layout": []} if gpu_v else {})


def _producer_with_fake_swap(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    p = Producer(cfg, 0, None, None, RecordingEndpoint(), None, Cursor())
    p.producer_id = "p0"
    swaps = []

    async def fake_load(ref, route, transfer):
        swaps.append((ref.version, bool(ref.uri)))
        p.weights.tracker.version = ref.version
        return SimpleNamespace(ok=True, version=ref.version, error="", timings={})

    p.weights.load = fake_load
    return p, swaps


def test_target_prefers_a_newer_gpu_copy_and_never_goes_back(tmp_path):
    p, _ = _producer_with_fake_swap(tmp_path)
    assert p._target(_ann(0, None), "file") is None
    ref = p._target(_ann(0, 1), "ipc")
    assert (ref.version, ref.uri) == (1, "")           # GPU copy before any file
    assert p._target(_ann(0, 1), "file") is None       # file route: wait for the file
    ref = p._target(_ann(1, 1), "nccl")
    assert (ref.version, ref.uri) == (1, "/snap/v1")   # both: the file ref (rollback target)
    p.weights.tracker.version, p._loaded_session = 3, "s"
    assert p._target(_ann(2, None), "file") is None     # older file of the same learner: ignored
    assert p._target(_ann(2, None, session="t"), "file").version == 2  # a restarted learner


def test_producer_follows_gpu_versions_ahead_of_their_files(tmp_path):
    p, swaps = _producer_with_fake_swap(tmp_path)

    async def run():
        await p._apply_announce(_ann(0, None))
        assert p.weights.tracker.version == 0 and p._synced.is_set()
        await p._apply_announce(_ann(0, 1))      # v1 by GPU, its file not written yet
        assert p.weights.tracker.version == 1 and p._synced.is_set()
        await p._apply_announce(_ann(0, 1))      # repeated announce: nothing to do
        await p._apply_announce(_ann(1, 2))      # v1's file lands as v2 goes out by GPU
        assert p.weights.tracker.version == 2
        await p._apply_announce(_ann(2, 2))      # v2's file: we run v2 already
        await p._apply_announce(_ann(2, None))   # GPU route gone: the file is what we run
        assert p._synced.is_set()

    asyncio.run(run())
    assert swaps == [(1, False), (2, False)]
    acks = [m for m in p.endpoint.sent if type(m).__name__ == "Ack"]
    assert [a.version for a in acks] == [1, 2] and all(a.ok for a in acks)


def test_file_route_producer_waits_for_the_file(tmp_path):
    p, swaps = _producer_with_fake_swap(tmp_path)

    async def run():
        await p._apply_announce(_ann(0, None))
        await p._apply_announce(_ann(1, None))
        assert p.weights.tracker.version == 1

    asyncio.run(run())
    assert swaps == [(1, True)]
