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
    out = subprocess.run(
        [sys.executable, str(script), "forget" if forget else "keep"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[4],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])},
    )
    assert out.returncode == 0, out.stderr
    assert ("resource_tracker" in out.stderr) is not forget, out.stderr


# ------------------------------------------------- leftovers of a launcher killed with -9

_ENGINE_LIKE = """
import mmap, os, sys, time
from pathlib import Path
from pipeline.launch.shm import list_segments, record_segments
from pipeline.owner import owned_name

shm = Path(sys.argv[1])
before = list_segments(shm)
snap = shm / owned_name(sys.argv[2])  # what the learner names its snapshot dir
snap.mkdir()
(snap / "v1.safetensors").write_bytes(b"w" * (1 << 20))
maps = []
for i in range(2):  # what its engines create and keep mapped
    p = shm / f"psm_{sys.argv[2]}{i}"
    p.write_bytes(b"s" * (256 << 10))
    fd = os.open(p, os.O_RDWR)
    maps.append(mmap.mmap(fd, 256 << 10))
    os.close(fd)
record_segments(before, shm)
print("ready", flush=True)
time.sleep(600)
"""


def _start_owner(tmp_path, stem):
    """A real process that leaves what a launcher and its children leave in /dev/shm (here a
    stand-in directory), then waits to be killed."""
    script = tmp_path / "owner.py"
    script.write_text(_ENGINE_LIKE)
    repo = Path(__file__).resolve().parents[4]
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_GRPO_OWNER"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "shm"), stem],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**env, "PYTHONPATH": str(repo)},
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_killed_launchers_leftovers_are_reclaimed_and_a_live_ones_kept(tmp_path, caplog):
    import logging
    import signal

    from pipeline.launch.shm import reclaim_dead_owners

    shm = tmp_path / "shm"
    shm.mkdir()
    dead = _start_owner(tmp_path, "dead")
    live = _start_owner(tmp_path, "live")
    unrelated = _segment(shm, "psm_unrelated")  # created by someone else meanwhile: not ours
    try:
        os.kill(dead.pid, signal.SIGKILL)  # the launcher itself killed: nothing cleaned up
        dead.wait()
        names = sorted(p.name for p in shm.iterdir())
        assert f"pipeline-grpo-dead.owner-{dead.pid}" in " ".join(names)
        with caplog.at_level(logging.INFO, logger="pipeline.launch.shm"):
            removed, freed = reclaim_dead_owners(shm)
        assert removed == 3  # its snapshot dir and both of its engine segments
        assert freed >= (1 << 20) + 2 * (256 << 10)
        left = sorted(p.name for p in shm.iterdir())
        assert not [n for n in left if "dead" in n], left
        # The live owner's directory, segments and record all stay, as does the stranger.
        assert {"psm_live0", "psm_live1", "psm_unrelated"} <= set(left)
        assert any(n.startswith("pipeline-grpo-live.owner-") for n in left)
        assert any(n.startswith("pipeline-grpo-segments.owner-") for n in left)
        assert unrelated.exists()
        lines = [r.getMessage() for r in caplog.records if "reclaimed" in r.getMessage()]
        assert len(lines) == 1 and "1 snapshot dir(s), 2 engine segment(s)" in lines[0]
        assert f"{freed / 1e6:.1f} MB" in lines[0]
        assert reclaim_dead_owners(shm) == (0, 0)  # nothing twice
    finally:
        live.kill()
        live.wait()
    assert reclaim_dead_owners(shm)[0] == 3  # once its owner is gone, it goes too


def test_a_recorded_segment_still_mapped_by_a_live_process_is_kept(tmp_path):
    from pipeline.launch.shm import reclaim_dead_owners, record_segments

    before = list_segments(tmp_path)
    kept = _segment(tmp_path, "psm_kept")
    gone = _segment(tmp_path, "psm_gone")
    record_segments(before, tmp_path, owner="999999999-1")  # an owner that cannot exist
    fd = os.open(kept, os.O_RDWR)
    m = mmap.mmap(fd, 4096)  # e.g. an engine core that outlived its launcher
    os.close(fd)
    try:
        assert reclaim_dead_owners(tmp_path)[0] == 1
        assert kept.exists() and not gone.exists()
    finally:
        m.close()
    # Its user gone, the segment goes at the next reclaim: the record kept it.
    assert reclaim_dead_owners(tmp_path)[0] == 1
    assert not kept.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pipeline-grpo-segments")]


def test_owner_tags_see_through_reused_pids_and_zombies():
    import signal

    from pipeline.owner import owner_alive, owner_tag, start_time

    me = owner_tag()
    assert owner_alive(me)
    pid, start = me.split("-")
    assert not owner_alive(f"{pid}-{int(start) + 1}")  # same pid, another process
    assert owner_alive(pid)  # no start time recorded: the pid alone decides
    assert owner_alive("garbage")  # never reclaim what cannot be placed
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tag = owner_tag(child.pid)
    assert owner_alive(tag) and start_time(child.pid) is not None
    os.kill(child.pid, signal.SIGKILL)
    for _ in range(100):  # a zombie until reaped: already dead
        if not owner_alive(tag):
            break
        import time

        time.sleep(0.05)
    assert not owner_alive(tag)
    child.wait()
    assert not owner_alive(tag)


def test_segments_recorded_by_a_live_owner_are_its_own(tmp_path):
    """A running launcher's record names its segments (a killed engine's among them, until it
    reclaims them); a dead launcher's record does not count."""
    import os

    from pipeline.launch.shm import recorded_by_live_owners
    from pipeline.owner import owned_name, owner_tag

    (tmp_path / owned_name("segments", owner_tag(os.getpid()))).write_text("psm_live\n")
    (tmp_path / owned_name("segments", "999999999-1")).write_text("psm_dead\n")
    assert recorded_by_live_owners(tmp_path) == {"psm_live"}
    assert recorded_by_live_owners(tmp_path / "absent") == set()
