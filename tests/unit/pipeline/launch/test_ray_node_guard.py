"""The private Ray node's guard (pipeline.launch.ray_node.guard) on real processes: a stand-in
for ``ray start`` (a shell in a session of its own with a child, as ``ray start`` has gcs and
raylet) and a stand-in owner. Without Ray: what is tested is the guard's own logic."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline.launch.ray_node import session_processes
from pipeline.owner import owner_tag


def _node_stand_in() -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)


def _guard(owner: str, session: int, temp_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.launch.ray_node", "guard", owner,
                             str(session), str(temp_dir)], start_new_session=True)


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_owner_killed_stops_the_whole_session_and_removes_the_temp_dir(tmp_path):
    owner = subprocess.Popen(["sleep", "300"])
    node = _node_stand_in()
    temp_dir = tmp_path / "node-temp"
    temp_dir.mkdir()
    guard = _guard(owner_tag(owner.pid), node.pid, temp_dir)
    try:
        assert _wait(lambda: len(session_processes(node.pid)) == 3, 10)
        time.sleep(1.0)
        assert guard.poll() is None and len(session_processes(node.pid)) == 3  # owner alive
        owner.kill()
        owner.wait()
        assert guard.wait(30) == 0
        assert session_processes(node.pid) == []
        assert not temp_dir.exists()
    finally:
        for p in (owner, node, guard):
            p.kill()
        node.wait()


def test_a_node_stopped_normally_lets_the_guard_exit_and_keeps_the_owner(tmp_path):
    owner = subprocess.Popen(["sleep", "300"])
    node = _node_stand_in()
    guard = _guard(owner_tag(owner.pid), node.pid, tmp_path)
    try:
        assert _wait(lambda: len(session_processes(node.pid)) == 3, 10)
        for p in session_processes(node.pid):
            p.kill()
        assert guard.wait(10) == 0
        assert psutil.pid_exists(owner.pid) and owner.poll() is None
        assert tmp_path.exists()  # only a dead owner's node loses its temp dir
    finally:
        for p in (owner, node, guard):
            p.kill()
        node.wait()
