"""What a `pipeline-train` run shows and records (real launcher, real vLLM CPU engine, a reward
that fails about 30% of its calls): a quiet console, one log file per process holding the engine's
INFO lines, every producer counter in metrics.jsonl and TensorBoard. (--verbose, which shows it
all on the console: test_shm_reclaim.py.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.support.launcher import VLLM_RECORD, read_metrics
from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow



def vllm_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if VLLM_RECORD.search(x) or "vllm" in x.lower()]


def _train(tiny_model: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return pipeline_train(*tiny_args(tiny_model, run_dir),
                          "--reward", "tests.e2e.support.flaky_rewards:flaky", "--mode", "async",
                          "--max-staleness", "1", "--tensorboard", "true", *extra,
                          tag=run_dir.name)


def test_quiet_console_logs_per_process_and_a_failing_rewards_counts_in_metrics(
    tiny_model, tmp_path
):
    run_dir = tmp_path / "flaky"
    proc = _train(tiny_model, run_dir, "--steps", "4")
    console = proc.stdout + proc.stderr
    assert len(vllm_lines(console)) < 10, console
    assert [x for x in proc.stdout.splitlines() if x.startswith("step ")][-1].startswith(
        "step 4/4 | reward"
    ), proc.stdout
    assert "reward: first" in proc.stdout and "logs: " in proc.stdout
    # Producers start no group beyond the run's last step: none is left undelivered at its end.
    assert "generated but not delivered" not in console, console
    # The failures are warnings: they reach the console (with the prompt id).
    assert "reward flaky raised RuntimeError('reward service unavailable (503)')" in proc.stderr
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        "launcher.log",
        "learner.log",
        "producer-0.log",
    ]
    producer_log = (logs / "producer-0.log").read_text()
    assert len(vllm_lines(producer_log)) >= 10  # the engine's INFO lines, its core's included
    assert re.search(r"\(EngineCore\S* pid=\d+\) INFO", producer_log), producer_log[-3000:]
    assert "connected at version 0" in (logs / "learner.log").read_text()
    assert "step 4/4" in (logs / "learner.log").read_text()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    calls, failures = last["reward/flaky/calls"], last["reward/flaky/failures"]
    assert calls >= 8 and 0 < failures < calls, (calls, failures)
    assert 0.05 <= failures / calls <= 0.7, (calls, failures)
    assert last["by_producer/p0/reward/flaky/failures"] == failures  # one producer: its sum
    assert last["reward/flaky/timeouts"] == 0 and last["reward/flaky/nan"] == 0
    counts = [r["reward/flaky/failures"] for r in rows if "reward/flaky/failures" in r]
    assert counts == sorted(counts)  # a counter never goes backwards
    assert last["producer/groups_sent"] >= 4 and last["producer/swaps"] >= 1
    # A rate over the time the engine generated: far above tokens / process lifetime.
    assert last["gen_tokens_per_s"] > 0 and last["producer/busy_s"] > 0
    assert last["gen_tokens_per_s"] == pytest.approx(
        last["producer/tokens"] / last["producer/busy_s"], rel=0.05
    )

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"reward/flaky/failures", "producer/swaps"} <= set(acc.Tags()["scalars"])
