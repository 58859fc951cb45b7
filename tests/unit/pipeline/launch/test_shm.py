"""pipeline.launch.shm: only unmapped segments created after the snapshot are removed
(real /proc)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.launch.shm import list_segments, reclaim_orphans


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


_TRACKED = """
import multiprocessing as mp, os, sys
from multiprocessing import shared_memory
from pipeline.launch.shm import forget_tracked

def child(conn):
    seg = shared_memory.SharedMemory(create=True, size=64)  # registered with the parent's tracker
    conn.send(seg.name)
    os._exit(0)  # dies like a killed engine core: no unlink, no unregister

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=child, args=(there,))
    p.start()
    name = here.recv()
    p.join()
    os.unlink(f"/dev/shm/{name}")  # what reclaim_orphans does
    if sys.argv[1] == "forget":
        forget_tracked([name])
"""


@pytest.mark.parametrize("forget", [True, False])
def test_forget_tracked_silences_the_shared_trackers_double_unlink(forget, tmp_path):
    """Real spawn children and the real resource tracker: without forget_tracked the launcher's
    exit prints the two warnings users saw at the end of every run."""
    script = tmp_path / "tracked.py"
    script.write_text(_TRACKED)
    out = subprocess.run([sys.executable, str(script), "forget" if forget else "keep"],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[4],
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])})
    assert out.returncode == 0, out.stderr
    assert ("resource_tracker" in out.stderr) is not forget, out.stderr
