"""Fault injection on real runs of `pipeline-train` (launcher, vLLM CPU engines, 2 producers):
kill -9 of a producer (restarted, run completes) and of the learner (everything stops, --resume
continues from the last checkpoint), and a rogue process flooding the learner's data socket with
groups that are wrong for the run (every one rejected and counted, conservation exact)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from bench.soak import tally
from buffer.checks import REASONS
from buffer.store import RolloutBuffer
from pipeline.launch.shm import list_segments, segments_in_use
from pipeline.learner.checkpoint import latest_checkpoint, load_checkpoint
from tests.e2e.support.launcher import ENGINE_START_S, REPO, Launcher, assert_gone, read_metrics
from tests.e2e.support.rogue import FORGERIES  # the process the fuzz test runs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_producer_killed_is_restarted_and_run_completes(tiny_model, tmp_path):
    """Sync mode: a batch needs both producers' shares, so the learner waits for the restarted
    producer; the run must still finish every step."""
    run_dir = tmp_path / "kill_producer"
    steps = 4
    shm_before = list_segments()
    la = Launcher(tiny_model, run_dir, "--mode", "sync", "--steps", str(steps),
                  "--max-producer-restarts", "1")
    try:
        first = la.wait_for(lambda: {p: pid for p, pid, _v in la.connects()}
                            if {"p0", "p1"} <= {c[0] for c in la.connects()} else None,
                            ENGINE_START_S, "both producers to connect")
        la.wait_for(lambda: la.steps_done() >= 1, ENGINE_START_S, "the first step")
        victim = first["p1"]
        assert psutil.Process(victim).ppid() == la.proc.pid  # a launcher child
        victim_group = [c.pid for c in psutil.Process(victim).children(recursive=True)]
        os.killpg(victim, signal.SIGKILL)  # the producer and its engine core, as an OOM kill
        killed_at = la.steps_done()
        assert killed_at < steps, "run finished before the producer was killed"
        la.wait_for(lambda: [c for c in la.connects() if c[0] == "p1" and c[1] != victim],
                    ENGINE_START_S, "the restarted producer p1 to reconnect")
        # The killed engine's shared memory (nobody unlinks it after SIGKILL; Python's resource
        # tracker would only at the launcher's exit) was reclaimed before the restart.
        assert (list_segments() - shm_before) - segments_in_use() == set()
        code = la.wait(300)
        assert code == 0, la.tail()
    finally:
        la.stop()
    log = "\n".join(la.lines)
    assert "producer 1 died" in log and "restarting (1/1)" in log
    p1 = [c for c in la.connects() if c[0] == "p1"]
    assert len(p1) == 2 and p1[1][1] != victim
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["skipped_nonfinite"] == 0 for r in rows)
    assert all(r["staleness_max"] == 0 for r in rows)  # sync mode stays on-policy
    served = 2 * steps
    assert rows[-1]["received"] >= served
    received = [r["received"] for r in rows]
    assert received == sorted(received)  # cumulative counter never goes backwards
    state = json.loads((run_dir / "checkpoints" / f"step_{steps}" / "state.json").read_text())
    assert state["step"] == steps
    assert sum(state["received"].values()) >= served
    assert state["received"].get("p1", 0) >= 1
    assert_gone(victim_group)  # the killed producer's engine core was reaped too
    assert_gone(la.descendants)  # learner, producers and their vLLM engine cores
    assert (list_segments() - shm_before) - segments_in_use() == set()


def test_learner_killed_stops_everything_then_resume_continues(tiny_model, tmp_path):
    run_dir = tmp_path / "kill_learner"
    steps = 6
    args = ("--mode", "async", "--max-staleness", "1", "--steps", str(steps),
            "--train.checkpoint_every", "1")
    la = Launcher(tiny_model, run_dir, *args)
    latest = run_dir / "checkpoints" / "LATEST"
    try:
        la.wait_for(lambda: latest.exists() and la.steps_done() >= 2, ENGINE_START_S,
                    "two steps and a checkpoint")
        producers = {pid for _p, pid, _v in la.connects()}
        kids = psutil.Process(la.proc.pid).children()
        # The launcher starts the learner before the producers; a producer whose engine is
        # still starting has not connected yet, so it is told apart by its later start.
        others = sorted((c for c in kids if c.pid not in producers
                         and "resource_tracker" not in " ".join(c.cmdline())),
                        key=lambda c: (c.create_time(), c.pid))
        assert 1 <= len(others) <= 2, [(c.pid, c.cmdline()) for c in kids]
        learner = others[:1]
        every = psutil.Process(la.proc.pid).children(recursive=True)
        names = [c.name() for c in every]
        every = [c.pid for c in every]
        os.kill(learner[0].pid, signal.SIGKILL)
        code = la.wait(120)
    finally:
        la.stop()
    assert code != 0
    assert "learner exited with code -9" in la.tail(200)
    assert any("VLLM" in n for n in names), names  # the engines were running
    assert_gone(every)
    assert_gone(la.descendants)  # learner, producers and their vLLM engine cores

    ckpt = run_dir / "checkpoints" / latest.read_text().strip()
    state = json.loads((ckpt / "state.json").read_text())
    k, v = state["step"], state["version"]
    assert 1 <= k < steps
    n_before = len(read_metrics(run_dir))
    assert n_before >= k

    la = Launcher(tiny_model, run_dir, *args, "--resume")
    try:
        code = la.wait(ENGINE_START_S)
    finally:
        la.stop()
    assert code == 0, la.tail()
    assert f"step {k}, version {v}" in "\n".join(la.lines)
    resumed = read_metrics(run_dir)[n_before:]
    assert [r["step"] for r in resumed] == list(range(k + 1, steps + 1))
    versions = [r["version"] for r in resumed]
    assert versions[0] >= v and versions == sorted(versions)
    assert versions[0] >= v + 1 or steps == k + 1  # publishes v+1 after its first step
    # Producers reconnected to the resumed learner. Not necessarily both: the remaining steps can
    # all be trained on the groups of the first engine up while the other is still starting.
    joined = {c[0] for c in la.connects()}
    assert joined and joined <= {"p0", "p1"}, la.connects()
    final = json.loads((run_dir / "checkpoints" / f"step_{steps}" / "state.json").read_text())
    assert final["step"] == steps and final["version"] >= v
    assert sum(final["received"].values()) >= sum(state["received"].values())
    assert_gone(la.descendants)  # learner, producers and their vLLM engine cores


def test_rogue_groups_are_all_rejected_and_counted_and_conservation_is_exact(tiny_model,
                                                                           tmp_path):
    """A rogue process poses as producer p0 (its incarnation, from the announcements) and sends
    thousands of well-formed groups, each wrong for the run in one way drawn at random from
    buffer.checks, and hundreds of forged control messages (a Hello of a producer the run does
    not have, acks, heartbeats and SyncReady from incarnations or producers never welcomed),
    while the real producers and the learner run. Every step finishes, nothing is dropped in
    training, every rogue group and forgery is rejected and counted under its reason (none is
    acted on: no sync failure in p0's name, no wait for a forged producer), and the real
    producers' groups are all placed: produced = trained + dropped + held."""
    run_dir = tmp_path / "rogue"
    steps, count, forge = 20, 3000, 600
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    # Admissions throttled to one group per producer every 2 s: a step takes about 2 s, so the
    # run outlasts the flood even when a busy machine starves the learner's event loop.
    la = Launcher(tiny_model, run_dir, "--mode", "sync", "--steps", str(steps),
                  "--generation.admit_rate_per_s", "0.5")
    out = tmp_path / "rogue.json"
    rogue = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "e2e" / "support" / "rogue.py"),
         "--addr", f"ipc://{run_dir.resolve()}/learner.sock", "--count", str(count),
         "--out", str(out), "--group-size", "4", "--vocab", str(vocab), "--max-tokens", "8",
         "--max-model-len", "256", "--window", "2", "--min-version", "3",
         "--forge", str(forge)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        la.wait_for(lambda: out.exists() or rogue.poll() is not None, 400, "the rogue's flood")
        # The rogue stays connected until the learner has counted its groups (libzmq drops
        # what a disconnected sender left in the receive queue), long before the last step.
        la.wait_for(lambda: read_metrics(run_dir)[-1].get("rejected_groups", 0) >= count, 400,
                    "every rogue group to be counted")
        _, err = rogue.communicate(timeout=60)  # closes its stdin: it disconnects and exits
        assert rogue.returncode == 0, err
        code = la.wait(400)
    finally:
        if rogue.poll() is None:
            rogue.kill()
        la.stop()
    assert code == 0, la.tail()
    result = json.loads(out.read_text())
    sent, forged = result["sent"], result["forged"]
    assert sum(sent.values()) == count and set(sent) == set(REASONS), sent
    assert sum(forged.values()) == forge and set(forged) == set(FORGERIES), forged
    assert result["refused"] == forged  # each forgery answered with a refusal naming why

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["dropped_batches"] == 0 and r["skipped_nonfinite"] == 0 for r in rows)
    # The final checkpoint is written after the last frame was read: exact counts per reason.
    _state, _t, buf = load_checkpoint(latest_checkpoint(run_dir))
    st = RolloutBuffer.restore(buf, capacity=10**9, max_staleness=None).stats
    assert st.rejected_groups == sent
    last = rows[-1]
    assert {r: last.get(f"rejected/{r}") for r in FORGERIES} == forged
    assert not [ln for ln in la.lines if "failed to sync" in ln or "no ack from" in ln]
    assert last.get("sync_failures", 0) == 0
    assert last["rejected_groups"] == sum(last.get(f"rejected_groups/{r}", 0) for r in REASONS)
    assert 0 < last["rejected_groups"] <= count
    t = tally(run_dir)
    assert t["lost"] == 0 and t["buffer_invariant_ok"], t
    # Real producers' groups: none rejected, each trained, dropped or held.
    assert t["produced"] - t["pending_in_outbox_logs"] == (
        t["trained"] + t["dropped_stale"] + t["dropped_capacity"] + t["held"]), t
    assert t["rejected_groups"] == count
    # A flood is counted, not logged line by line: at most a few lines per reason.
    logged = [ln for ln in la.lines if "rejected group rogue-" in ln]
    assert len(logged) <= 20 * len(REASONS)
    assert_gone(la.descendants)
