"""`pipeline-train --launcher ray` on a real three-node Ray cluster on loopback.

Nodes (each its own `ray start`, temp dir, TMPDIR and custom resource): 127.0.0.2 (head,
`producer_node`), 127.0.0.3 (`learner_node`), 127.0.0.4 (`producer_node`). The driver runs beside
the head. The learner must land on .3 and one producer on each of the others; neither producer
shares the learner's node, so every version reaches them through the streamed transport into
their own node's temp dir (no shared snapshot directory). Mid-run one producer actor's process is
killed with SIGKILL: Ray restarts it and nothing is lost (conservation from the run's records).
Bad input (an unreachable address, resources no node has) fails in seconds with one line.

Faults beyond a producer's process: the learner actor's process killed with SIGKILL (Ray restarts
it from its last checkpoint, the producers rejoin and resend) and a whole worker node lost (every
process of 127.0.0.4 killed: the run goes on with the other producer). The head's GCS checks its
raylets every second, so a dead node is seen in a few seconds (Ray's default is ~15 s).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.soak import tally
from pipeline.launch.ray_node import RayNode
from pipeline.launch.shm import list_segments
from tests.e2e.support.launcher import CONNECTED, REPO, Launcher, assert_gone, read_metrics
from tests.e2e.support.ray_nodes import loopback_cluster
from tests.e2e.support.ray_runs import (
    HEALTH_CHECK,
    LEARNER,
    NO_MEMORY_MONITOR,
    PLACED,
    assert_run_clean,
    ray_args,
    stop_and_keep_log,
)

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]

NODES = {"127.0.0.2": "producer_node", "127.0.0.3": "learner_node", "127.0.0.4": "producer_node"}


@pytest.fixture(scope="module")
def cluster():
    nodes = {ip: {resource: 1} for ip, resource in NODES.items()}
    with loopback_cluster("pgt", nodes, num_cpus=2, env=NO_MEMORY_MONITOR,
                          head_env=HEALTH_CHECK) as started:
        yield started


def test_three_nodes_placement_streamed_weights_and_producer_kill(
    cluster, tiny_model, tmp_path, monkeypatch
):
    tag = f"ray{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)  # forwarded to the actors (runtime_env)
    shm_before = list_segments()
    run_dir = tmp_path / "run"
    # Sync mode: every step needs both producers' groups, so the learner waits for the killed
    # one's successor (in async mode the other producer could fill every step alone). The run
    # has no last step of its own (the tiny model trains a step in a fraction of a second): the
    # kill cannot race with its end; Ctrl-C ends it two steps after the restart.
    la = Launcher(
        tiny_model,
        run_dir,
        *ray_args(
            cluster,
            "--mode",
            "sync",
            "--steps",
            "100000",
            "--max-producer-restarts",
            "1",
        ),
    )
    placed = PLACED
    try:
        la.wait_for(
            lambda: len([ln for ln in la.lines if re.search(placed, ln)]) == 2,
            300,
            "both producers placed",
        )
        actors = {
            int(m[1]): (m[2], int(m[3]), int(m[4]))
            for ln in la.lines
            if (m := re.search(placed, ln))
        }
        la.wait_for(lambda: la.steps_done() >= 1, 400, "the first trained step")
        _ip, actor_pid, child_pid = actors[1]
        victims = [child_pid] + [c.pid for c in psutil.Process(child_pid).children(True)]
        os.kill(actor_pid, signal.SIGKILL)  # the producer actor's process, as an OOM kill
        la.wait_for(
            lambda: any("producer 1 restarted by Ray" in ln for ln in la.lines),
            300,
            "Ray to restart producer 1",
        )
        assert_gone(victims, "the killed actor's producer and engine")
        after = la.steps_done() + 2
        la.wait_for(lambda: la.steps_done() >= after, 400, "two steps after the restart")
        la.proc.send_signal(signal.SIGINT)  # Ctrl-C: final checkpoint, files come back
        code = la.wait(300)
    finally:
        log = stop_and_keep_log(la, run_dir / "driver.log")
    assert code == 130, la.tail(80)

    # Placement, from node ids: the learner on .3, one producer on each other node.
    node_ids = {ip: n.node_id for ip, n in cluster.items()}
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["learner"] == node_ids["127.0.0.3"]
    assert {placement["producer0"], placement["producer1"]} == {
        node_ids["127.0.0.2"],
        node_ids["127.0.0.4"],
    }
    assert {actors[0][0], actors[1][0]} == {"127.0.0.2", "127.0.0.4"}

    # Every step trained, reward logged; metrics came back from the learner's node.
    rows = read_metrics(run_dir)
    steps = len(rows)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and steps >= 3
    assert all("reward_mean" in r for r in rows)
    assert all(r["staleness_max"] == 0 for r in rows)
    # No shared snapshot directory: both producers streamed every version into their node.
    assert log.count("weights streamed from tcp://127.0.0.3:") >= 3  # p0, p1 and p1's successor
    assert "refused" not in log and "checksum" not in log
    assert "swap_load_s" in {k for r in rows for k in r}
    learner_dir = next((cluster["127.0.0.3"].temp_dir / "tmp" / "pipeline-grpo-ray").iterdir())
    assert (learner_dir / "checkpoints").is_dir()  # checkpoints stay on the learner's node
    assert (run_dir / "checkpoints" / f"step_{steps}" / "state.json").is_file()  # mirrored
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == f"step_{steps}"
    # Every role's log file is in run_dir/logs, copied back from the other nodes.
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert {"learner.log", "producer-0.log", "producer-1.log"} <= set(logs), sorted(logs)
    assert "producer 1 stopped" in logs["producer-1.log"]

    # Conservation, exact: what the producers (the killed one too) sent = trained + dropped +
    # held, nothing lost.
    t = tally(run_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["incarnations"] == 3, t  # p0, p1 and p1 restarted by Ray
    assert t["trained"] == 2 * steps, t

    # Teardown: no process of the run, no shared-memory segment left.
    # (A killed actor's multiprocessing resource tracker prints its own KeyError tracebacks.)
    assert_run_clean(la, tag, shm_before, log)
    key = hashlib.sha1(str(learner_dir.resolve()).encode()).hexdigest()[:12]
    assert not list(Path("/dev/shm").glob(f"pipeline-grpo-{key}*"))  # the learner's snapshots
    for node in cluster.values():
        assert not list((node.temp_dir / "tmp").glob("pipeline-grpo-stream-*")), node.ip
        assert not list((node.temp_dir / "tmp").glob("pipeline-keys-*")), node.ip


def _bad(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.launch.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stderr, time.monotonic() - t0


def test_unreachable_address_is_one_line(tiny_model, tmp_path):
    code, err, took = _bad(
        "--launcher",
        "ray",
        "--ray-address",
        "127.0.0.9:1",
        "--model",
        str(tiny_model),
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert code == 2 and took < 30, (code, took, err)
    assert err.strip().splitlines() == [err.strip().splitlines()[-1]], err
    assert "launch.ray_address" in err and "127.0.0.9:1" in err


def test_missing_resource_is_named_within_30s(cluster, tiny_model, tmp_path):
    code, err, took = _bad(
        *ray_args(
            cluster,
            "--set",
            "launch.learner_resources={gpu_node: 1}",
            "--set",
            "launch.ray_timeout_s=10",
            "--model",
            str(tiny_model),
            "--run-dir",
            str(tmp_path / "r"),
        )
    )
    assert code == 2 and took < 30, (code, took, err)
    last = err.strip().splitlines()[-1]
    assert "cannot place the learner" in last and "'gpu_node'" in last, err
    assert "Traceback" not in err


def _node_dir(node: RayNode, run_dir: Path) -> Path:
    """The run's directory on a node that is not the driver's
    (pipeline.launch.ray_actors.role_workdir)."""
    key = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return node.temp_dir / "tmp" / "pipeline-grpo-ray" / f"{run_dir.name}-{key}"


def _conservation(run_dir: Path, steps: int) -> dict:
    t = tally(run_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["incarnations"] >= 2, t  # both producers sent groups
    assert t["steps"] == steps and t["trained"] >= 2 * steps, t
    return t


def test_learner_killed_is_restarted_from_its_checkpoint(
    cluster, tiny_model, tmp_path, monkeypatch
):
    """kill -9 of the learner actor's process: its child kills its group, Ray restarts the actor
    on the same node and ports, the learner resumes from its last checkpoint, the producers
    rejoin at its version and resend what that checkpoint does not hold; every step is trained
    once in the final lineage and conservation is exact."""
    tag = f"rayl{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)
    shm_before = list_segments()
    run_dir = tmp_path / "run"
    # No last step of its own: the kill cannot race with the run's end; Ctrl-C ends it two
    # steps after both producers rejoined the restarted learner.
    la = Launcher(
        tiny_model,
        run_dir,
        *ray_args(
            cluster,
            "--mode",  # sync: every step needs both producers, so both rejoin the new learner
            "sync",
            "--steps",
            "100000",
            "--train.checkpoint_every",
            "1",
            "--max-learner-restarts",
            "1",
        ),
    )
    try:
        m = la.wait_for(
            lambda: next((m for ln in la.lines if (m := re.search(LEARNER, ln))), None),
            300,
            "the learner placed",
        )
        actor_pid, child_pid = int(m[1]), int(m[2])
        la.wait_for(lambda: {c[0] for c in la.connects()} == {"p0", "p1"}, 400, "both producers")
        latest = _node_dir(cluster["127.0.0.3"], run_dir) / "checkpoints" / "LATEST"
        la.wait_for(lambda: la.steps_done() >= 2 and latest.exists(), 400,
                    "two trained steps and a checkpoint on the learner's node")
        victims = [child_pid] + [c.pid for c in psutil.Process(child_pid).children(True)]
        os.kill(actor_pid, signal.SIGKILL)
        la.wait_for(
            lambda: any("learner restarted by Ray" in ln for ln in la.lines),
            120,
            "Ray to restart the learner",
        )
        assert_gone(victims, "the killed actor's learner")

        def rejoined() -> set[str]:
            restart = next(i for i, ln in enumerate(la.lines) if "learner restarted by Ray" in ln)
            return {m[1] for ln in la.lines[restart:] if (m := CONNECTED.search(ln))}

        la.wait_for(lambda: rejoined() == {"p0", "p1"}, 400, "both producers to rejoin")
        after = la.steps_done() + 2
        la.wait_for(lambda: la.steps_done() >= after, 300, "two steps after the rejoin")
        la.proc.send_signal(signal.SIGINT)  # Ctrl-C: final checkpoint, files come back
        code = la.wait(300)
    finally:
        log = stop_and_keep_log(la, run_dir / "driver.log")
    assert code == 130, la.tail(80)
    assert "learner actor restarted by Ray from its last checkpoint" in log, log[-3000:]
    rows = read_metrics(run_dir)
    # Steps after the resumed checkpoint are trained again: each step is there, in order per
    # lineage, and the last row is the last step.
    steps = rows[-1]["step"]
    assert {r["step"] for r in rows} == set(range(1, steps + 1)), [r["step"] for r in rows]
    assert max(r["step"] for r in rows) == steps
    assert not re.search(r"producer \d restarted by Ray", log)
    _conservation(run_dir, steps)
    assert_run_clean(la, tag, shm_before, log)


def test_worker_node_lost_run_goes_on(cluster, tiny_model, tmp_path, monkeypatch):
    """Every process of 127.0.0.4 killed (the node is gone, its disk stays): Ray sees the node
    dead within seconds, the driver reports the lost producer, and the learner goes on training
    with the producer left. STRICT_SPREAD leaves no node for the lost bundle, so Ray keeps the
    actor pending (its restart waits for a node). The run is open-ended (an engine may take
    minutes to start on a loaded machine) and stopped with Ctrl-C ten steps after the report.
    Last in the module: the node stays dead."""
    tag = f"rayn{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)
    shm_before = list_segments()
    run_dir = tmp_path / "run"
    la = Launcher(
        tiny_model,
        run_dir,
        *ray_args(
            cluster, "--mode", "async", "--max-staleness", "1", "--steps", "100000",
            "--max-producer-restarts", "1",
            # While one engine takes minutes to start, the tiny model trains hundreds of versions
            # on the other producer's groups: a late producer's download of the version it was
            # announced must still find that file.
            "--sync.keep_snapshots", "64",
        ),
    )  # fmt: skip
    node = cluster["127.0.0.4"]
    try:
        la.wait_for(
            lambda: len([ln for ln in la.lines if re.search(PLACED, ln)]) == 2,
            300,
            "both producers placed",
        )
        actors = {m[2]: (int(m[1]), int(m[3])) for ln in la.lines if (m := re.search(PLACED, ln))}
        lost, actor_pid = actors["127.0.0.4"]
        la.wait_for(lambda: {c[0] for c in la.connects()} == {"p0", "p1"}, 500, "both producers")
        sent = f"by_producer/p{lost}/groups_sent"
        la.wait_for(
            lambda: la.steps_done() >= 2 and read_metrics(run_dir)[-1].get(sent, 0) >= 2,
            300,
            f"two trained steps and groups from p{lost}",
        )
        procs = node.processes() + psutil.Process(actor_pid).children(True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        killed = time.monotonic()
        la.wait_for(
            lambda: any(f"producer {lost} lost: its node" in ln for ln in la.lines),
            60,
            "the driver to report the lost producer",
        )
        seen_s = time.monotonic() - killed
        reported = la.steps_done()
        assert_gone([p.pid for p in procs], "the lost node's processes")
        la.wait_for(lambda: la.steps_done() >= reported + 10, 300, "ten steps after the loss")
        la.proc.send_signal(signal.SIGINT)  # Ctrl-C: final checkpoint, producers stop
        code = la.wait(300)
    finally:
        la.stop()
        log = "\n".join(la.lines)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "driver.log").write_text(log)  # for a failure's post-mortem
    assert code == 130, la.tail(80)
    assert seen_s < 12, f"node loss seen after {seen_s:.1f}s"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) >= reported + 10
    # Conservation on the learner's node (its final checkpoint) with every producer's records:
    # the lost one's sent log and outbox stay on its node's disk (the driver cannot fetch them).
    learner_dir = _node_dir(cluster["127.0.0.3"], run_dir)
    (learner_dir / "producers").mkdir(exist_ok=True)
    for src in (run_dir / "producers", _node_dir(node, run_dir) / "producers"):
        for f in src.glob("p*"):
            if f.suffix in (".jsonl", ".wal"):
                shutil.copy(f, learner_dir / "producers" / f.name)
    t = tally(learner_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["incarnations"] == 2 and t["steps"] == len(rows), t
    assert_run_clean(la, tag, shm_before, log)
