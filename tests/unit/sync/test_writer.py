"""SnapshotWriter: files written in the background from packed buffers, newest version wins,
failures surface on the training side (real files in a temp dir; CPU buffers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from sync.packing import pack, plan_layout
from sync.snapshot import SnapshotError, read_snapshot, write_packed
from sync.writer import SnapshotWriter


def _packed(value: float):
    tensors = {"a": torch.full((3, 5), value, dtype=torch.bfloat16),
               "n": torch.arange(7, dtype=torch.int64) * int(value),
               "f": torch.full((100,), value)}
    layout = plan_layout(tensors)
    return tensors, pack(tensors, layout, "cpu"), layout


def test_write_packed_round_trips_through_read_snapshot(tmp_path):
    tensors, flat, layout = _packed(2.0)
    ref = write_packed(flat, layout, 4, tmp_path)
    back = read_snapshot(ref)
    assert ref.version == 4 and set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert not list(tmp_path.glob(".*tmp"))


def test_write_packed_checksum_covers_the_file(tmp_path):
    _t, flat, layout = _packed(1.0)
    ref = write_packed(flat, layout, 1, tmp_path)
    path = Path(ref.uri)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        read_snapshot(ref)


def test_writer_announces_each_file_and_prunes(tmp_path):
    written = []

    async def on_written(ref, seconds):
        written.append(ref.version)

    async def main():
        w = SnapshotWriter(tmp_path, keep=2, on_written=on_written)
        task = asyncio.create_task(w.run())
        for v in (1, 2, 3):
            w.submit(v, *_packed(float(v))[1:])
            await w.flush()
        task.cancel()
        return w

    w = asyncio.run(main())
    assert written == [1, 2, 3] and w.skipped == 0
    assert sorted(p.name for p in tmp_path.glob("policy_v*")) == \
        ["policy_v2.safetensors", "policy_v3.safetensors"]
    assert torch.equal(read_snapshot(w.written)["n"], torch.arange(7) * 3)


def test_newest_submitted_version_replaces_a_pending_one(tmp_path):
    written = []

    async def main():
        gate = asyncio.Event()

        async def on_written(ref, seconds):
            written.append(ref.version)
            if ref.version == 1:
                await gate.wait()  # hold the writer busy while 2 and 3 are submitted

        w = SnapshotWriter(tmp_path, keep=5, on_written=on_written)
        task = asyncio.create_task(w.run())
        w.submit(1, *_packed(1.0)[1:])
        while not written:
            await asyncio.sleep(0.01)
        w.submit(2, *_packed(2.0)[1:])
        w.submit(3, *_packed(3.0)[1:])  # 2 has not started: it is replaced
        gate.set()
        await w.flush()
        task.cancel()
        return w

    w = asyncio.run(main())
    assert written == [1, 3] and w.skipped == 1


def test_a_failed_write_is_raised_on_the_next_submit_and_flush(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")

    async def main():
        w = SnapshotWriter(blocker, keep=2)
        task = asyncio.create_task(w.run())
        w.submit(1, *_packed(1.0)[1:])
        with pytest.raises(RuntimeError, match="writing a snapshot file failed"):
            await w.flush()
        with pytest.raises(RuntimeError, match="writing a snapshot file failed"):
            w.submit(2, *_packed(2.0)[1:])
        task.cancel()

    asyncio.run(main())


def test_write_now_writes_without_the_loop(tmp_path):
    async def main():
        w = SnapshotWriter(tmp_path, keep=2)
        return await w.write_now(5, *_packed(5.0)[1:])

    ref = asyncio.run(main())
    assert ref.version == 5 and read_snapshot(ref)["f"][0] == 5.0
