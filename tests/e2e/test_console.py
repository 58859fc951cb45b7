"""What a `pipeline-train` run shows and records: counters of every producer in metrics.jsonl
(real launcher, real vLLM CPU engine, a reward that fails about 30% of its calls)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_process_left

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _train(tiny_model: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(tiny_model),
           "--data", "arithmetic:200", "--reward", "tests.e2e.flaky_rewards:flaky",
           "--num-producers", "1", "--batch-groups", "2", "--group-size", "4",
           "--max-tokens", "8", "--run-dir", str(run_dir), "--mode", "async",
           "--max-staleness", "1", "--engine.max_model_len", "256",
           "--engine.cpu_kvcache_space_gib", "1", "--tensorboard", "true", *extra]
    env = dict(os.environ, PIPELINE_TEST_RUN=run_dir.name + str(os.getpid()),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_no_process_left(env["PIPELINE_TEST_RUN"])
    return proc


def test_a_failing_rewards_counts_reach_metrics_and_tensorboard(tiny_model, tmp_path):
    run_dir = tmp_path / "flaky"
    _train(tiny_model, run_dir, "--steps", "4")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    calls, failures = last["reward/flaky/calls"], last["reward/flaky/failures"]
    assert calls >= 8 and 0 < failures < calls, (calls, failures)
    assert 0.05 <= failures / calls <= 0.7, (calls, failures)
    assert last["by_producer/p0/reward/flaky/failures"] == failures  # one producer: its sum
    assert last["reward/flaky/timeouts"] == 0 and last["reward/flaky/nan"] == 0
    counts = [r["reward/flaky/failures"] for r in rows if "reward/flaky/failures" in r]
    assert counts == sorted(counts)  # a counter never goes backwards
    assert last["producer/groups_sent"] >= 8 and last["producer/swaps"] >= 1
    # A rate over the time the engine generated: far above tokens / process lifetime.
    assert last["gen_tokens_per_s"] > 0 and last["producer/busy_s"] > 0
    assert last["gen_tokens_per_s"] == pytest.approx(
        last["producer/tokens"] / last["producer/busy_s"], rel=0.05)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"reward/flaky/failures", "producer/swaps"} <= set(acc.Tags()["scalars"])
