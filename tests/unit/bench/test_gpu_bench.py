"""bench.gpu_bench: steady-window arithmetic and the report (pure logic, synthetic rows)."""

from __future__ import annotations

import pytest

from bench.gpu_bench import RunResult, parse_args, summarize, write_report


def _rows(n: int, step_s: float, tokens: float = 100.0) -> list[dict]:
    return [{"step": i + 1, "ts": 1000.0 + i * step_s, "step_s": step_s, "trained_tokens": tokens,
             "reward_mean": 0.1 * i, f"staleness_hist/{i % 2}": 4.0,
             **({"sync_s": 0.5, "swap_idle_s": 0.1} if i else {})} for i in range(n)]


def test_summarize_counts_only_the_steady_window():
    res = summarize("x", _rows(6, 2.0), wall_s=30.0, warmup=1, batch_samples=8, sampler=None,
                    roles={})
    # window = steps 3..6 (4 steps) over ts[5] - ts[1] = 8 s
    assert res.ok and res.window_steps == 4
    assert res.samples_per_s == pytest.approx(4 * 8 / 8.0)
    assert res.tokens_per_s == pytest.approx(4 * 100 / 8.0)
    assert res.step_s_median == 2.0 and res.sync_s_mean == 0.5 and res.swap_idle_s_mean == 0.1
    assert res.staleness == {"0": 8.0, "1": 8.0}
    assert res.reward_curve[0] == (0.0, 0.0) and len(res.reward_curve) == 6


def test_summarize_flags_a_run_too_short_for_a_window():
    res = summarize("x", _rows(2, 1.0), wall_s=5.0, warmup=1, batch_samples=8, sampler=None,
                    roles={})
    assert not res.ok and "only 2 steps" in res.note


def test_report_prints_ratios_and_marks_failures(tmp_path):
    args = parse_args(["--layout", "cpu", "--model", "tiny", "--out", str(tmp_path)])
    results = [RunResult("sync", True, 10.0, samples_per_s=10.0),
               RunResult("async1", True, 10.0, samples_per_s=18.0),
               RunResult("async2", False, 1.0, note="exit 1: boom")]
    text = write_report(tmp_path, results, args, "test device")
    assert "async1/sync = 1.80x" in text and "async2/sync = n/a" in text
    assert "FAILED exit 1: boom" in text
    assert (tmp_path / "results.png").stat().st_size > 0 and (tmp_path / "results.json").exists()


@pytest.mark.parametrize("argv", [["--runs", "sync,turbo"], ["--trl", "remote"],
                                  ["--steps", "3", "--warmup-steps", "2"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_run_group_timeout_stops_the_whole_process_group(tmp_path):
    import sys

    import psutil

    from bench.gpu_bench import run_group

    pidfile = tmp_path / "child.pid"
    # A parent that would leave a child behind (as an engine core would) if only it were killed.
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    with open(tmp_path / "log", "w") as log:
        assert run_group([sys.executable, "-c", script], log, timeout=3, grace=2) == -1
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    with open(tmp_path / "log2", "w") as log:  # a normal exit returns its code
        assert run_group([sys.executable, "-c", "raise SystemExit(3)"], log, timeout=30) == 3
