"""The driver of `pipeline-train --launcher ray` killed with SIGKILL mid-run, on its private Ray
node: nothing may outlive it, and `--resume` must finish the run with nothing lost.

Ray stops the actors a dead driver owns; the actors' children (learner, producers, vLLM engine
cores) kill their groups once their actor is gone; the private node itself (a `ray start` in a
session of its own) is stopped by its guard (pipeline.launch.ray_node.guard), which also removes
the node's temp dir. The resumed run starts a new private node, the learner resumes from its last
checkpoint and the producers resend what their outboxes hold, so every step is trained and
conservation is exact across both drivers.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from conftest import assert_no_process_left

from bench.soak import tally
from pipeline.launch.shm import list_segments
from tests.e2e.support.launcher import Launcher, assert_gone, leaked_segments, read_metrics
from tests.e2e.support.ray_runs import ray_args, stop_and_keep_log

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _node_temp_dirs(pids: set[int]) -> set[str]:
    """The private node's temp dir, from its `ray start --temp-dir DIR` command line."""
    dirs = set()
    for pid in pids:
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if "start" in cmd and "--temp-dir" in cmd:
            dirs.add(cmd[cmd.index("--temp-dir") + 1])
    return dirs


def test_driver_killed_leaves_nothing_running_and_resume_finishes_the_run(
    tiny_model, tmp_path, monkeypatch
):
    tag = f"raydrv{time.time_ns()}"
    monkeypatch.setenv("PIPELINE_TEST_RUN", tag)
    shm_before = list_segments()
    run_dir = tmp_path / "run"
    # The first run has no last step of its own (the kill ends it, never a race with its end);
    # the resumed run goes on to two steps past the killed run's last row.
    args = ray_args(None, "--mode", "async", "--train.checkpoint_every", "1")
    first = Launcher(tiny_model, run_dir, *args, "--steps", "100000")
    try:
        first.wait_for(lambda: first.steps_done() >= 2, 400, "two trained steps")
        victims = set(first.descendants)
        temp_dirs = _node_temp_dirs(victims)
        assert temp_dirs, "no `ray start --temp-dir` among the driver's processes"
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        assert_gone(victims, "left behind by the killed driver", timeout=60)
        assert_no_process_left(tag)
        assert not any(os.path.exists(d) for d in temp_dirs), temp_dirs
    finally:
        stop_and_keep_log(first, tmp_path / "first.log")
    killed_at = len(read_metrics(run_dir))
    steps = killed_at + 2

    second = Launcher(tiny_model, run_dir, *args, "--steps", str(steps), "--resume")
    try:
        code = second.wait(600)
    finally:
        stop_and_keep_log(second, tmp_path / "second.log")
    assert code == 0, second.tail(60)
    rows = read_metrics(run_dir)
    assert len(rows) > killed_at
    assert {r["step"] for r in rows} == set(range(1, steps + 1)), [r["step"] for r in rows]
    t = tally(run_dir)
    assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
    assert t["steps"] == steps, t
    assert_no_process_left(tag)
    assert leaked_segments(shm_before) == set()
