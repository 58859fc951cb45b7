"""``executor: ray`` on a real two-node Ray cluster on loopback: a small CPU reward model
(tests/e2e/support/reward_model.py) served by two replicas that both producers of a real
``pipeline-train --launcher ray`` run share. Mid-run one replica is killed with SIGKILL while it
scores: Ray restarts it, the call it held is retried on the other replica (counted), every step
trains, the reward is logged and conservation is exact; at the end no replica is left.

Nodes (each its own ``ray start``, temp dir and TMPDIR): 127.0.0.2 (head, ``learner_node``) and
127.0.0.3 (``producer_node`` for both producers), so the producers' reward clients join the
cluster from another raylet than the driver's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_no_process_left

from bench.soak import tally
from tests.e2e.support.launcher import REPO, Launcher, assert_gone, read_metrics
from tests.e2e.support.ray_nodes import loopback_cluster

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]

NODES = {"127.0.0.2": {"learner_node": 1}, "127.0.0.3": {"producer_node": 2}}


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster("pgr", NODES, num_cpus=3) as started:
        yield started


class ConfigLauncher(Launcher):
    """``Launcher`` with the rewards of a config file (its ``--reward`` would replace them)."""

    def __init__(self, tiny_model: Path, run_dir: Path, config: Path, *extra: str):
        real_popen = subprocess.Popen

        def popen(cmd, *a, **kw):
            i = cmd.index("--reward")
            return real_popen([*cmd[:i], "--config", str(config), *cmd[i + 2 :]], *a, **kw)

        subprocess.Popen = popen
        try:
            super().__init__(tiny_model, run_dir, *extra)
        finally:
            subprocess.Popen = real_popen


def _killer(markers: Path, stop: threading.Event, killed: list[int]) -> None:
    """Kill -9 the first replica seen scoring (its busy marker exists while a call runs)."""
    while not stop.is_set():
        for m in markers.glob("*.busy"):
            pid = int(m.stem)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
            return
        time.sleep(0.02)


def test_reward_replicas_shared_and_one_killed_mid_call(cluster, tiny_model, tmp_path, monkeypatch):
    tag = f"rayrw{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)  # forwarded to the actors (runtime_env)
    markers = tmp_path / "markers"
    markers.mkdir()
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({"digit": 1.0, "space": 0.25, "other": 0.0}))
    config = tmp_path / "rewards.yaml"
    spec = {
        "fn": f"{REPO}/tests/e2e/support/reward_model.py:TinyRewardModel",
        "name": "rm",
        "executor": "ray",
        "num_replicas": 2,
        "num_cpus": 0.5,
        "max_restarts": 2,
        "timeout_s": 60,
        "kwargs": {"weights_path": str(weights), "marker_dir": str(markers), "delay_s": 0.15},
    }
    config.write_text(json.dumps({"rewards": {"specs": [spec]}}))
    run_dir = tmp_path / "run"
    la = ConfigLauncher(
        tiny_model,
        run_dir,
        config,
        "--launcher",
        "ray",
        "--ray-address",
        cluster["127.0.0.2"].address,
        "--set",
        "launch.learner_resources={learner_node: 1}",
        "--set",
        "launch.producer_resources={producer_node: 1}",
        "--mode",
        "sync",
        "--steps",
        "100000",  # no last step of its own: Ctrl-C ends it after the restart, not a race
    )
    stop, killed = threading.Event(), []
    try:
        la.wait_for(
            lambda: any("reward actors up: rm x2" in ln for ln in la.lines),
            300,
            "the reward replicas",
        )
        replicas = {int(p.stem) for p in markers.glob("*.pid")}
        assert len(replicas) == 2, replicas
        la.wait_for(lambda: la.steps_done() >= 1, 400, "the first trained step")
        killer = threading.Thread(target=_killer, args=(markers, stop, killed), daemon=True)
        killer.start()
        la.wait_for(lambda: killed, 120, "a replica seen scoring, killed")
        assert killed[0] in replicas
        la.wait_for(
            lambda: any("reward rm replica" in ln and "restarted by Ray" in ln for ln in la.lines),
            120,
            "Ray to restart the killed replica",
        )
        after = la.steps_done() + 2
        la.wait_for(lambda: la.steps_done() >= after, 300, "two steps after the restart")
        la.proc.send_signal(signal.SIGINT)  # Ctrl-C: final checkpoint, replicas stopped
        code = la.wait(300)
    finally:
        stop.set()
        la.stop()
    log = "\n".join(la.lines)
    (run_dir / "driver.log").write_text(log)
    assert code == 130, la.tail(80)

    # Every step trained with the model's reward; both producers called the shared replicas.
    rows = read_metrics(run_dir)
    steps = len(rows)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all("reward/rm" in r and 0.0 <= r["reward/rm"] <= 1.0 for r in rows), rows[-1]
    last = rows[-1]
    for p in ("p0", "p1"):
        assert last[f"by_producer/{p}/reward/rm/calls"] > 0, last
    # The call the killed replica held was retried on the other one, not lost.
    assert last["reward/rm/retries"] >= 1, {k: v for k, v in last.items() if "reward" in k}
    assert last["reward/rm/failures"] == 0, last
    assert "retrying on the next one" in log

    # Conservation, exact.
    t = tally(run_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["trained"] == 2 * steps, t

    # The replicas (the restarted one too) die with the run; nothing of the run is left.
    every = {int(p.stem) for p in markers.glob("*.pid")}
    assert len(every) == 3, every  # two replicas and the successor of the killed one
    assert_gone(every, "reward replicas")
    assert_gone(la.descendants, "driver children")
    assert_no_process_left(tag)
    assert f'File "{REPO}/' not in log, log[-3000:]
    assert "SIGTERM received" not in log and "SIGTERM handler is not set" not in log


def test_replicas_that_cannot_be_placed_are_named_within_30s(cluster, tiny_model, tmp_path):
    config = tmp_path / "rewards.yaml"
    spec = {
        "fn": f"{REPO}/tests/e2e/support/reward_model.py:TinyRewardModel",
        "executor": "ray",
        "num_gpus": 1,  # the loopback cluster has none
        "kwargs": {"weights_path": "x", "marker_dir": "y"},
    }
    config.write_text(json.dumps({"rewards": {"specs": [spec]}}))
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.launch.cli",
            "--config",
            str(config),
            "--model",
            str(tiny_model),
            "--run-dir",
            str(tmp_path / "r"),
            "--launcher",
            "ray",
            "--ray-address",
            cluster["127.0.0.2"].address,
            "--set",
            "launch.learner_resources={learner_node: 1}",
            "--set",
            "launch.producer_resources={producer_node: 1}",
            "--set",
            "launch.ray_timeout_s=10",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert p.returncode == 2 and took < 30, (p.returncode, took, p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    assert "rewards.specs[0]: reward 'TinyRewardModel': cannot place its replicas" in last, last
    assert "GPU: 1" in last and "Traceback" not in p.stderr


SCORE_IN_CHILD = """
import asyncio, json, sys
from pipeline.config import RewardSpec
from pipeline.producer.rewards.runner import RewardSet
rs = RewardSet([RewardSpec(**json.loads(sys.argv[1]))])
res = asyncio.run(rs.score_group("q", ["12 ab", "99", ""], {"prompt_id": "p"}))
rs.close()
print(json.dumps({"total": res.total, "stats": rs.stats}))
"""


def test_local_launcher_starts_replicas_for_its_processes(cluster, tmp_path):
    """What the local launcher does given --ray-address, without engines: ``RewardCluster``
    starts the replicas from this process, and a separate process (as a local producer is)
    inherits where they are, joins the cluster and scores through ``RewardSet``; ``stop``
    removes the replicas."""
    from pipeline.config import load_config
    from pipeline.launch.ray_cluster import RewardCluster

    markers = tmp_path / "markers"
    markers.mkdir()
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({"digit": 1.0, "space": 0.25, "other": 0.0}))
    spec = {
        "fn": f"{REPO}/tests/e2e/support/reward_model.py:TinyRewardModel",
        "name": "rm",
        "executor": "ray",
        "num_replicas": 2,
        "num_cpus": 0.5,
        "kwargs": {"weights_path": str(weights), "marker_dir": str(markers), "delay_s": 0.01},
    }
    cfg = load_config(
        overrides={
            "launch.ray_address": cluster["127.0.0.2"].address,
            "rewards.specs": [spec],
            "run_dir": str(tmp_path / "run"),
        }
    )
    rc = RewardCluster(cfg)
    try:
        replicas = {int(p.stem) for p in markers.glob("*.pid")}
        assert len(replicas) == 2, replicas
        p = subprocess.run(
            [sys.executable, "-c", SCORE_IN_CHILD, json.dumps(spec)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        rc.stop()
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["total"] == [pytest.approx(2.25 / 5), 1.0, 0.0], out
    assert out["stats"]["reward/rm/calls"] == 3 and out["stats"]["reward/rm/failures"] == 0
    assert_gone(replicas, "reward replicas after stop()")
