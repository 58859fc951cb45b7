"""pipeline.shm: only unmapped segments created after the snapshot are removed (real /proc)."""

from __future__ import annotations

import mmap
import os

from pipeline.shm import list_segments, reclaim_orphans


def _segment(d, name: str, size: int = 4096):
    p = d / name
    with open(p, "wb") as fh:
        fh.truncate(size)
    return p


def test_orphans_go_mapped_and_older_segments_stay(tmp_path):
    old = _segment(tmp_path, "psm_old")
    before = list_segments(tmp_path)
    orphan = _segment(tmp_path, "psm_orphan")
    live = _segment(tmp_path, "psm_live")
    other = _segment(tmp_path, "not_ours")
    fd = os.open(live, os.O_RDWR)
    m = mmap.mmap(fd, 4096)  # a live creator keeps its segment mapped
    os.close(fd)
    try:
        assert reclaim_orphans(before, tmp_path) == ["psm_orphan"]
        assert not orphan.exists() and live.exists() and old.exists() and other.exists()
    finally:
        m.close()
    assert reclaim_orphans(before, tmp_path) == ["psm_live"]  # unmapped once its owner is gone


def test_an_open_descriptor_also_counts_as_in_use(tmp_path):
    before = list_segments(tmp_path)
    held = _segment(tmp_path, "psm_held")
    fd = os.open(held, os.O_RDONLY)
    try:
        assert reclaim_orphans(before, tmp_path) == [] and held.exists()
    finally:
        os.close(fd)


def test_missing_directory_is_not_an_error(tmp_path):
    assert list_segments(tmp_path / "nope") == set()
    assert reclaim_orphans(set(), tmp_path / "nope") == []
