"""Append-only record files on a real 1 MB filesystem (a tmpfs; needs root): a record the disk
has no room for leaves none of itself in the file, waits, and goes in once there is room."""

from __future__ import annotations

import pytest

from pipeline.appendfile import AppendFile, DiskFull
from tests.small_fs import fill, small_filesystem

RECORD = b"x" * 3000 + b"\n"


def test_a_record_that_does_not_fit_leaves_nothing_and_waits_for_room(tmp_path):
    with small_filesystem(tmp_path / "fs", 1) as fs:
        f = AppendFile(fs / "rows.jsonl")
        assert f.append(RECORD)
        fill(fs / "filler")
        for _ in range(3):  # the first may fit the page the file has begun
            f.append(RECORD)
        assert f.waiting, "the disk took every record"
        with pytest.raises(DiskFull):
            f.write(RECORD)
        on_disk = (fs / "rows.jsonl").read_bytes()
        assert len(on_disk) % len(RECORD) == 0 and set(on_disk.split(b"\n")[:-1]) == {
            RECORD[:-1]}  # whole records only, none torn
        (fs / "filler").unlink()
        assert f.retry() and not f.waiting
        f.close()
        assert (fs / "rows.jsonl").read_bytes() == RECORD * 4  # in order, each once
