"""``RayNode.wait_ready`` starts a node again when ``ray start`` gave up on its raylet's 30 s
registration (a busy machine), and only then. On real processes with a stand-in for the ``ray``
CLI (a shell script, named a fake): what is tested is the node's own retry logic."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pipeline.launch import ray_node
from pipeline.launch.ray_node import STARTUP_ATTEMPTS, STARTUP_TIMED_OUT, RayNode


def _ray_cli_fake(tmp_path: Path, fail_times: int, message: str) -> Path:
    """Exits 1 with ``message`` the first ``fail_times`` calls (leaving a session dir behind, as
    ``ray start`` does), then says the node started and blocks like ``ray start --block``."""
    count = tmp_path / "calls"
    script = tmp_path / "ray"
    script.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}
if [ $n -le {fail_times} ]; then
  mkdir -p "$RAY_TMPDIR/session_$n/logs"
  echo "Exception: {message}"; exit 1
fi
echo "Ray runtime started."; exec sleep 300
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def node_dir(tmp_path):
    d = tmp_path / "node"
    d.mkdir()
    return d


def test_a_registration_timeout_starts_the_node_again_fake_ray_cli(tmp_path, node_dir,
                                                                   monkeypatch):
    cli = _ray_cli_fake(tmp_path, 1, STARTUP_TIMED_OUT + " ...")
    monkeypatch.setattr(ray_node, "ray_executable", lambda: str(cli))
    node = RayNode("127.0.0.1", temp_dir=node_dir)
    try:
        node.wait_ready(60)
        assert node.starts == 2 and node.proc.poll() is None
        assert not list(node_dir.glob("session_*"))  # the first start's logs are gone
    finally:
        node.stop(grace_s=5)
    assert node.processes() == []


def test_it_gives_up_after_the_last_attempt_fake_ray_cli(tmp_path, node_dir, monkeypatch):
    cli = _ray_cli_fake(tmp_path, STARTUP_ATTEMPTS, STARTUP_TIMED_OUT)
    monkeypatch.setattr(ray_node, "ray_executable", lambda: str(cli))
    node = RayNode("127.0.0.1", temp_dir=node_dir)
    with pytest.raises(RuntimeError, match="timed out during startup"):
        node.wait_ready(60)
    assert node.starts == STARTUP_ATTEMPTS
    node.stop(grace_s=5)


def test_any_other_exit_is_an_error_at_once_fake_ray_cli(tmp_path, node_dir, monkeypatch):
    cli = _ray_cli_fake(tmp_path, 1, "Ray version mismatch")
    monkeypatch.setattr(ray_node, "ray_executable", lambda: str(cli))
    node = RayNode("127.0.0.1", temp_dir=node_dir)
    with pytest.raises(RuntimeError, match="version mismatch"):
        node.wait_ready(60)
    assert node.starts == 1
    node.stop(grace_s=5)
