"""A Ray cluster of loopback nodes for e2e tests: 127.0.0.2 is the head, each node has its own
temp dir (short: Ray's socket paths are length-limited) and custom resources, and every Ray
process is checked gone at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from pipeline.launch.ray_node import RayNode

REPO = Path(__file__).resolve().parents[3]
HEAD = "127.0.0.2"


@contextlib.contextmanager
def loopback_cluster(tag: str, nodes: dict[str, dict[str, float]], *, num_cpus: int,
                     env: dict[str, str] | None = None,
                     head_env: dict[str, str] | None = None) -> Iterator[dict[str, RayNode]]:
    """``nodes``: {ip: custom resources}, the head first; ``env`` goes to every node,
    ``head_env`` to the head only."""
    started: dict[str, RayNode] = {}
    try:
        for ip, resources in nodes.items():
            d = Path(f"/tmp/{tag}-{os.getpid()}-{ip.rsplit('.', 1)[1]}")
            (d / "tmp").mkdir(parents=True, exist_ok=True)
            head = started.get(HEAD)
            started[ip] = RayNode(
                ip,
                head_address=head.address if head else None,
                num_cpus=num_cpus,
                resources=resources,
                object_store_mb=128,
                temp_dir=d,
                env={"TMPDIR": str(d / "tmp"), "PYTHONPATH": str(REPO)}
                | (env or {})
                | ((head_env or {}) if head is None else {}),
            )
            started[ip].wait_ready(180)
        yield started
    finally:
        for node in reversed(list(started.values())):
            node.stop()
        for node in started.values():
            assert node.processes() == [], f"Ray processes of {node.ip} left behind"
            subprocess.run(["rm", "-rf", str(node.temp_dir)], check=False)
