"""pipeline.learner.loop.snapshot_dir: shared memory only when the snapshots fit in it."""

from __future__ import annotations

import shutil

from pipeline.learner.routes import snapshot_dir
from pipeline.owner import OWNER_ENV, owner_tag


def test_configured_dir_wins(tmp_path):
    assert (
        snapshot_dir("/x/snaps", tmp_path / "run", "k", 10**15, shm=tmp_path).as_posix()
        == "/x/snaps"
    )


def test_shared_memory_when_it_has_room_else_run_dir(tmp_path):
    shm, run = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    free = shutil.disk_usage(shm).free
    # Named with its owner's tag (here this process: no launcher set one).
    assert (
        snapshot_dir("", run, "k", free // 2, shm=shm)
        == shm / f"pipeline-grpo-k.owner-{owner_tag()}"
    )
    # Docker's 64 MB /dev/shm against a model's snapshots: run_dir instead of ENOSPC later.
    assert snapshot_dir("", run, "k", free * 2, shm=shm) == run / "snapshots"
    assert snapshot_dir("", run, "k", 1, shm=tmp_path / "absent") == run / "snapshots"


def test_a_restarted_learner_counts_its_own_snapshots_as_room(tmp_path, monkeypatch):
    monkeypatch.setenv(OWNER_ENV, "123-456")  # the launcher's tag, inherited by each learner
    shm, run = tmp_path / "shm", tmp_path / "run"
    mine = shm / "pipeline-grpo-k.owner-123-456"
    mine.mkdir(parents=True)
    size = 64 << 20
    with open(mine / "v1.safetensors", "wb") as f:  # allocated, so free space drops by it
        f.write(b"\1" * size)
    free = shutil.disk_usage(shm).free
    # Room only counting the 64 MB it already holds (32 MB slack for other writers meanwhile).
    assert snapshot_dir("", run, "k", free + size - (32 << 20), shm=shm) == mine
