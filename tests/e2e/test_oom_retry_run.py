"""An OOM in a training step through `pipeline-train` (real launcher, real vLLM CPU engine, the
tiny model): the test hook PIPELINE_TEST_OOM_ABOVE_TOKENS plays a card that fits fewer tokens
than the first micro-batches hold (pipeline.learner.oom). The console shows one line naming the
new train.micro_batch_tokens, the step is retried with the same batch, every step trains and no
group is dropped."""

from __future__ import annotations

import pytest

from pipeline.learner.oom import INJECT_ENV
from tests.e2e.support.launcher import read_metrics
from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow


def test_an_injected_oom_costs_one_console_line_and_no_group(tiny_model, tmp_path):
    run_dir = tmp_path / "oom"
    proc = pipeline_train(*tiny_args(tiny_model, run_dir), "--steps", "3",
                          "--train.micro_batch", "8", tag="oom", env={INJECT_ENV: "200"})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    oom = [x for x in console.splitlines() if "out of GPU memory" in x]
    assert len(oom) == 1 and "set --train.micro_batch_tokens" in oom[0], console[-3000:]
    assert "Traceback" not in console
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["oom_retries"] >= 1 and all(r["oom_retries"] == 0 for r in rows[1:])
    assert rows[-1]["micro_batch_tokens"] <= 200
    last = rows[-1]
    assert last["dropped_batches"] == 0 and last["dropped_batch_groups"] == 0
    assert last["dropped_stale"] == 0
