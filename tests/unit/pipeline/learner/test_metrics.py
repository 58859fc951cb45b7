"""Metrics sinks: JSONL round-trip and resume, progress lines, TensorBoard, plots, CLI."""

import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.learner.metrics import (
    METRICS_FILE,
    MetricsLogger,
    carry_counters,
    format_progress,
    main,
    plot_run,
    producer_metrics,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = Path(__file__).resolve().parents[4]


def quiet_logger(run_dir: Path, **kwargs) -> MetricsLogger:
    kwargs.setdefault("tensorboard", False)
    kwargs.setdefault("stream", io.StringIO())
    return MetricsLogger(run_dir, **kwargs)


# --- JSONL ------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path):
    with quiet_logger(tmp_path / "run") as logger:
        logger.log(1, {"reward_mean": 0.25, "tokens_per_s": 1200})
        logger.log(2, {"reward_mean": np.float32(0.5), "loss": torch.tensor(1.5)})
        # flushed per line: readable while the logger is still open
        assert len(read_metrics(tmp_path / "run" / METRICS_FILE)) == 2
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward_mean"] == 0.25 and records[0]["tokens_per_s"] == 1200
    assert records[1]["reward_mean"] == 0.5 and records[1]["loss"] == 1.5
    for r in records:
        assert r["time"] >= 0 and r["ts"] > 1.6e9
    assert records[1]["time"] >= records[0]["time"]
    # one JSON object per line
    lines = (tmp_path / "run" / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_resume_appends_and_keeps_time_and_first_reward(tmp_path):
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"reward_mean": 0.12})
        logger.log(2, {"reward_mean": 0.2})
    last_time = read_metrics(tmp_path / METRICS_FILE)[-1]["time"]

    stream = io.StringIO()
    with quiet_logger(tmp_path, stream=stream, total_steps=4) as logger:
        assert logger.first_reward == pytest.approx(0.12)
        logger.log(3, {"reward_mean": 0.4})
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["time"] >= last_time
    assert "reward 0.40 (first 0.12)" in stream.getvalue()


def test_torn_last_line_is_isolated_and_skipped(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "time": 5.0, "ts": 1700000000.0}\n{"step": 2, "ti')
    with pytest.warns(UserWarning, match="malformed"), quiet_logger(tmp_path) as logger:
        logger.log(2, {"reward_mean": 1.0})
    with pytest.warns(UserWarning, match="malformed"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["time"] >= 5.0


def test_reserved_keys_and_closed_logger(tmp_path):
    logger = quiet_logger(tmp_path)
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"time": 3.0})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"reward_mean": 0.0})


# --- progress ---------------------------------------------------------------------------------


def test_format_progress_full_line():
    metrics = {
        "reward_mean": 0.41,
        "tokens_per_s": 1800.0,
        "learner_tokens_per_s": 20400.0,
        "mfu": 0.412,
        "staleness_mean": 0.6,
        "buffer_size": 5,
        "sync_s": 0.42,
        "time": 190.0,
    }
    line = format_progress(12, 40, metrics, first_reward=0.12)
    # time left: 190 s / 12 steps * 28 steps = 443 s
    assert line == (
        "step 12/40 | reward 0.41 (first 0.12) | 1.8k tok/s | learner 20.4k tok/s 41% MFU | "
        "stale 0.6 | buffer 5 | "
        "sync 0.42s | 3m10s elapsed, ~7m23s left"
    )


def test_format_progress_partial():
    assert format_progress(0, None, {}) == "step 0"
    assert format_progress(3, None, {"tokens_per_s": 350, "time": 4000}) == (
        "step 3 | 350 tok/s | 1h06m elapsed"
    )
    assert format_progress(0, 10, {"time": 2.0}) == "step 0/10 | 2s elapsed"


def test_progress_prints_one_line_per_step(tmp_path):
    stream = io.StringIO()
    with quiet_logger(tmp_path, stream=stream, total_steps=2) as logger:
        logger.log(1, {"reward_mean": 0.1})
        logger.log(2, {"reward_mean": 0.3})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 1/2 | reward 0.10 (first 0.10)")
    assert lines[1].startswith("step 2/2 | reward 0.30 (first 0.10)")

    silent = io.StringIO()
    with quiet_logger(tmp_path / "b", stream=silent, progress=False) as logger:
        logger.log(1, {"reward_mean": 0.1})
    assert silent.getvalue() == ""


# --- TensorBoard ------------------------------------------------------------------------------


def test_tensorboard_event_file_written(tmp_path):
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:
        logger.log(1, {"reward_mean": 0.5, "note_is_skipped": "text"})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_tensorboard_unavailable_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with MetricsLogger(tmp_path, stream=io.StringIO()) as logger:
        with pytest.warns(UserWarning, match="TensorBoard logging disabled"):
            logger.log(1, {"reward_mean": 0.5})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logger.log(2, {"reward_mean": 0.6})
    assert len(read_metrics(tmp_path / METRICS_FILE)) == 2


# --- plot and CLI -----------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_single_point(tmp_path):
    with quiet_logger(tmp_path / "one") as logger:
        logger.log(1, {"reward_mean": 0.3, "staleness_mean": 0.0})
    out = plot_run(tmp_path / "one" / METRICS_FILE, tmp_path / "one.png")
    assert out == tmp_path / "one.png"
    assert_png(out)


def test_plot_many_points_with_staleness_histogram(tmp_path):
    path = tmp_path / "run" / METRICS_FILE
    path.parent.mkdir()
    with path.open("w") as f:
        for step in range(1, 61):
            record = {
                "step": step,
                "time": 10.0 * step,
                "ts": 1.7e9 + step,
                "reward_mean": step / 60,
                "staleness_hist/0": 3,
                "staleness_hist/1": step % 4,
                "staleness_hist/2": 1,
            }
            f.write(json.dumps(record) + "\n")
    assert_png(plot_run(path, tmp_path / "out" / "reward.png"))


def test_plot_without_reward_or_staleness(tmp_path):
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"loss": 0.1})
    assert_png(plot_run(tmp_path / METRICS_FILE, tmp_path / "p.png"))


def test_cli_plot(tmp_path, capsys):
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"reward_mean": 0.1, "staleness_mean": 1.0})
        logger.log(2, {"reward_mean": 0.2, "staleness_mean": 0.5})
    assert main(["plot", str(tmp_path)]) == 0
    assert_png(tmp_path / "reward.png")
    assert str(tmp_path / "reward.png") in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing")]) == 2


def test_cli_module_entry_point(tmp_path):
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"reward_mean": 0.1})
    subprocess.run(
        [sys.executable, "-m", "pipeline.learner.metrics", "plot", str(tmp_path)],
        check=True,
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=120,
    )
    assert_png(tmp_path / "reward.png")


def test_producer_metrics_per_producer_and_summed():
    m = producer_metrics({
        "p1": {"swaps": 2.0, "reward/flaky/failures": 3.0, "gen_tokens_per_s": 100.0},
        "p0": {"swaps": 1.0, "reward/flaky/failures": 4.0, "gen_tokens_per_s": 50.0},
    })
    assert m["by_producer/p0/swaps"] == 1.0 and m["by_producer/p1/swaps"] == 2.0
    assert m["by_producer/p1/reward/flaky/failures"] == 3.0
    assert m["producer/swaps"] == 3.0
    assert m["reward/flaky/failures"] == 7.0  # the name the reward counts under
    assert m["producer/gen_tokens_per_s"] == 150.0  # producers generating side by side
    assert producer_metrics({}) == {}


def test_carry_counters_keeps_a_restarted_producers_counts_but_not_its_rates():
    carried = carry_counters({}, {"swaps": 2.0, "gen_tokens_per_s": 80.0})
    assert carried == {"swaps": 2.0}
    again = carry_counters(carried, {"swaps": 1.0, "tokens": 5.0})
    assert again == {"swaps": 3.0, "tokens": 5.0}
    # What the learner logs for the producer's new process: its heartbeat plus the carry.
    new = {"swaps": 4.0, "gen_tokens_per_s": 90.0}
    assert {**new, **carry_counters(again, new)} == {"swaps": 7.0, "tokens": 5.0,
                                                     "gen_tokens_per_s": 90.0}


def test_producer_counters_reach_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    counters = producer_metrics({"p0": {"reward/flaky/failures": 3.0, "swaps": 1.0}})
    with quiet_logger(tmp_path, tensorboard=True) as logger:
        logger.log(1, counters)
    assert read_metrics(tmp_path / METRICS_FILE)[0]["reward/flaky/failures"] == 3.0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/flaky/failures", "producer/swaps", "by_producer/p0/swaps"} <= tags
