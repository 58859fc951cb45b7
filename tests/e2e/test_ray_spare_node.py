"""A producer's node lost, and Ray moving that producer to a spare node: the successor rejoins at
the learner's version and resends what its predecessor had not had acknowledged.

Four loopback nodes: the head 127.0.0.2 holds the learner (`learner_node`), and 127.0.0.3-5 each
offer one `producer_node`, so two STRICT_SPREAD producers leave one node spare. Every process of
one producer's node is killed; the head sees the node dead within seconds, Ray moves the lost
bundle of the placement group to the spare node and restarts the actor there
(`--max-producer-restarts 1`). The nodes share this machine's disk, so `launch.shared_run_dir`
holds for real: every outbox is in `run_dir`, and the successor reads its predecessor's.
Conservation is then exact from `run_dir` alone.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time

import psutil
import pytest

from bench.soak import tally
from pipeline.launch.shm import list_segments
from tests.e2e.support.launcher import Launcher, read_metrics
from tests.e2e.support.ray_nodes import loopback_cluster
from tests.e2e.support.ray_runs import (
    HEALTH_CHECK,
    NO_MEMORY_MONITOR,
    PLACED,
    assert_run_clean,
    ray_args,
    stop_and_keep_log,
)

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]

NODES = {"127.0.0.2": {"learner_node": 1}, "127.0.0.3": {"producer_node": 1},
         "127.0.0.4": {"producer_node": 1}, "127.0.0.5": {"producer_node": 1}}
RESTARTED = r"producer (\d) restarted by Ray \(pid \d+ -> (\d+)\) on node \w+ \(([\d.]+)\)"


def test_lost_producer_moves_to_the_spare_node_and_resends_its_outbox(
    tiny_model, tmp_path, monkeypatch
):
    tag = f"rays{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)
    shm_before = list_segments()
    run_dir = tmp_path / "run"
    with loopback_cluster("pgs", NODES, num_cpus=2, env=NO_MEMORY_MONITOR,
                          head_env=HEALTH_CHECK) as cluster:
        la = Launcher(
            tiny_model, run_dir, *ray_args(
                cluster, "--set", "launch.shared_run_dir=true",
                # sync: the surviving engine idles while the learner trains, so on this 2-core
                # machine (vLLM's CPU backend binds every engine's worker to core 0) the moved
                # producer's new engine gets CPU to start
                "--mode", "sync", "--steps", "100000",
                "--max-producer-restarts", "1", "--sync.keep_snapshots", "64",
            ),
        )  # fmt: skip
        try:
            la.wait_for(
                lambda: len([ln for ln in la.lines if re.search(PLACED, ln)]) == 2,
                300,
                "both producers placed",
            )
            placed = {m[2]: (int(m[1]), int(m[3]))
                      for ln in la.lines if (m := re.search(PLACED, ln))}
            (spare,) = {"127.0.0.3", "127.0.0.4", "127.0.0.5"} - set(placed)
            lost_ip = sorted(placed)[-1]
            lost, actor_pid = placed[lost_ip]
            la.wait_for(lambda: {c[0] for c in la.connects()} == {"p0", "p1"}, 500,
                        "both producers")
            sent = f"by_producer/p{lost}/groups_sent"
            la.wait_for(
                lambda: la.steps_done() >= 2 and read_metrics(run_dir)[-1].get(sent, 0) >= 2,
                300,
                f"two trained steps and groups from p{lost}",
            )
            node = cluster[lost_ip]
            procs = node.processes() + psutil.Process(actor_pid).children(True)
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            m = la.wait_for(
                lambda: next((m for ln in la.lines if (m := re.search(RESTARTED, ln))), None),
                300,
                "Ray to restart the lost producer on the spare node",
            )
            assert int(m[1]) == lost and m[3] == spare, m.group(0)
            # The successor said Hello to the learner and its groups are trained.
            la.wait_for(lambda: sum(1 for c in la.connects() if c[0] == f"p{lost}") >= 2, 500,
                        "the moved producer to rejoin")
            before = read_metrics(run_dir)[-1].get(sent, 0)
            la.wait_for(lambda: read_metrics(run_dir)[-1].get(sent, 0) >= before + 2, 300,
                        "groups from the moved producer")
            la.proc.send_signal(signal.SIGINT)  # Ctrl-C: final checkpoint, producers stop
            code = la.wait(300)
        finally:
            log = stop_and_keep_log(la, run_dir / "driver.log")
    assert code == 130, la.tail(80)
    assert f"producer {lost} lost: its node" in log, log[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    t = tally(run_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["incarnations"] == 3 and t["steps"] == len(rows), t
    assert_run_clean(la, tag, shm_before, log)
