"""One Ray node that this process owns: ``ray start --block`` in its own session, with every port
chosen free, its own temp dir and a capped object store.

Used for the Ray launcher's private instance (no ``--ray-address``) and by the tests' loopback
clusters. ``ray stop`` would stop every Ray process of the machine (other users' clusters too);
``RayNode.stop`` stops only this node: SIGTERM to its ``ray start`` (which drains and stops the
node's processes), then SIGKILL to whatever is left of its session.

The node lives in a session of its own, so nothing stops it when its owner dies without calling
``stop`` (kill -9 of the driver, OOM): given ``owner``, a small guard process (``python -m
pipeline.launch.ray_node guard``, in a session of its own too) does that stop once the owner is
gone, removes the node's temp dir and reclaims what the node's actors left in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from buffer.ports import free_ports
from pipeline.owner import owner_alive

# What ``ray start`` prints when its raylet did not register with the GCS within its fixed 30 s
# (ray/_private/node.py): a busy machine, worth one more start (RayNode.wait_ready).
STARTUP_TIMED_OUT = "The current node timed out during startup"
STARTUP_ATTEMPTS = 3

PORT_OPTIONS = (
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--node-manager-port",
    "--object-manager-port",
)


def worker_range(taken: list[int], width: int = 101) -> tuple[int, int]:
    """A ``width``-port range for the node's workers that holds none of ``taken`` (the node's
    own component ports, which ``ray start`` refuses to see inside the range): the first gap
    wide enough above the lowest of them, else just below it."""
    ports = sorted(taken)
    for low, nxt in zip(ports, [*ports[1:], 65536], strict=True):
        if nxt - low - 1 >= width:
            return low + 1, low + width
    if ports[0] - width >= 10002:
        return ports[0] - width, ports[0] - 1
    raise RuntimeError(f"no range of {width} worker ports beside {ports}")


def ray_executable() -> str:
    """The ``ray`` CLI of this interpreter's environment."""
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


class RayNode:
    """A head (``head_address`` None) or a worker joining ``head_address``, on ``ip``."""

    def __init__(
        self,
        ip: str = "127.0.0.1",
        *,
        head_address: str | None = None,
        num_cpus: float | None = None,
        resources: dict[str, float] | None = None,
        labels: dict[str, str] | None = None,
        object_store_mb: int = 256,
        temp_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        owner: str | None = None,
    ):
        self.ip = ip
        self.own_temp = temp_dir is None
        # Ray's socket paths must stay short (AF_UNIX limit): a short name under /tmp.
        self.temp_dir = Path(temp_dir or tempfile.mkdtemp(prefix="pgray", dir="/tmp"))
        self.head_address = head_address
        # What every start of this node passes besides its ports.
        self._node_args = ["--object-store-memory", str(object_store_mb << 20)]
        if num_cpus is not None:
            self._node_args += ["--num-cpus", str(num_cpus)]
        if resources:
            self._node_args += ["--resources", json.dumps(resources)]
        if labels:
            self._node_args += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        self._env, self._owner = env, owner
        self.log_path = self.temp_dir / "ray-start.log"
        self.starts = 0
        self.guard: subprocess.Popen | None = None
        self._spawn()

    def _spawn(self) -> None:
        """``ray start`` in a session of its own, on fresh free ports, and its guard."""
        ip = self.ip
        ports = free_ports(ip, len(PORT_OPTIONS) + 2)
        low, high = worker_range(ports)
        head = self.head_address is None
        self.port = ports.pop() if head else None
        self.address = f"{ip}:{self.port}" if head else self.head_address
        cmd = [
            ray_executable(),
            "start",
            "--block",
            "--node-ip-address",
            ip,
            "--temp-dir",
            str(self.temp_dir),
            *self._node_args,
            "--disable-usage-stats",
        ]
        if head:
            cmd += [
                "--head",
                "--port",
                str(self.port),
                "--include-dashboard",
                "false",
                "--ray-client-server-port",
                str(ports.pop()),
            ]
        else:
            cmd += ["--address", self.head_address]
        for opt in PORT_OPTIONS:
            cmd += [opt, str(ports.pop())]
        cmd += ["--min-worker-port", str(low), "--max-worker-port", str(high)]
        node_env = os.environ | {"RAY_TMPDIR": str(self.temp_dir)} | (self._env or {})
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=node_env, start_new_session=True
            )
        self.starts += 1
        self.session = self.proc.pid  # start_new_session: the session id is its pid
        if self._owner is not None:
            self.guard = subprocess.Popen(
                [sys.executable, "-m", "pipeline.launch.ray_node", "guard", self._owner,
                 str(self.session), str(self.temp_dir) if self.own_temp else ""],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the node runs its raylet (the log says the node started).

        ``ray start`` gives its raylet a fixed 30 s to register with the GCS and exits if it
        has not: on a busy machine that is no fault of the node. Then the node is stopped and
        started again on fresh ports, within the same ``timeout_s`` (at most
        ``STARTUP_ATTEMPTS`` starts in all); any other exit is an error at once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.starts < STARTUP_ATTEMPTS and \
                        STARTUP_TIMED_OUT in self.log_path.read_text(errors="replace"):
                    self._stop_session()
                    for old in self.temp_dir.glob("session_*"):  # its logs name the old node
                        if old.is_symlink() or old.is_file():
                            old.unlink()
                        else:
                            shutil.rmtree(old, ignore_errors=True)
                    self._spawn()
                    continue
                raise RuntimeError(
                    f"ray start on {self.ip} exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            if "Ray runtime started" in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"ray node on {self.ip} not up within {timeout_s:.0f}s:\n{self.log_tail()}"
        )

    @property
    def node_id(self) -> str:
        """The raylet's node id (hex), as Ray's APIs report it ('' before the node is up)."""
        for f in self.temp_dir.glob("session_*/logs/raylet.out"):
            with contextlib.suppress(OSError):
                m = re.search(r"Setting node ID node_id=([0-9a-f]+)", f.read_text(errors="replace"))
                if m:
                    return m.group(1)
        return ""

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def processes(self) -> list[psutil.Process]:
        """Every live process of this node (its session: gcs, raylet, agents, workers)."""
        return session_processes(self.session)

    def stop(self, grace_s: float = 20.0) -> None:
        self._stop_session(grace_s)
        if self.own_temp:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop_session(self, grace_s: float = 20.0) -> None:
        stop_session(self.session, grace_s, self.proc)
        if self.guard is not None:  # it sees the session gone and exits
            try:
                self.guard.wait(5)
            except subprocess.TimeoutExpired:
                self.guard.kill()
                self.guard.wait()
            self.guard = None


def session_processes(session: int) -> list[psutil.Process]:
    """The live processes of ``session`` (zombies are dead, only not yet reaped)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == session and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def stop_session(session: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM to ``ray start`` (the session's leader: its pid is the session id; ``proc`` when
    it is our child), up to ``grace_s`` for it to stop its node, then SIGKILL to whatever is
    left of its session."""
    if proc is not None:
        if proc.poll() is None:  # a reaped child's pid may belong to another process by now
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
    else:  # not our child: poll (a zombie counts as gone)
        with contextlib.suppress(psutil.Error):
            psutil.Process(session).send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(
            p.pid == session for p in session_processes(session)
        ):
            time.sleep(0.2)
    left = session_processes(session)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=10)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def guard(owner: str, session: int, temp_dir: str, period_s: float = 0.5) -> None:
    """Until the node's session is gone (a normal stop), or its owner is (then stop it)."""
    while session_processes(session):
        if not owner_alive(owner):
            stop_session(session, grace_s=20.0)
            if temp_dir:
                shutil.rmtree(temp_dir, ignore_errors=True)
            from pipeline.launch.shm import dead_owned, reclaim_dead_owners

            # What the node's actors recorded in /dev/shm; their engines may outlive them by a
            # few seconds (their children's parent watch), and a segment still mapped stays.
            deadline = time.monotonic() + 30.0
            while True:
                reclaim_dead_owners()
                if not any(p.is_file() for p in dead_owned()) or time.monotonic() > deadline:
                    return
                time.sleep(1.0)
        time.sleep(period_s)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "guard":
        guard(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit("usage: python -m pipeline.launch.ray_node guard OWNER SESSION TEMP_DIR")
