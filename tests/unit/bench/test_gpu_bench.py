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
                                  ["--steps", "3", "--warmup-steps", "2"],
                                  ["--layout", "split-3x1"],  # 16 groups over 3 producers
                                  ["--layout", "split-3x1", "--batch-groups", "15",
                                   "--trl", "server"],
                                  ["--layout", "split-tp2", "--trl", "server"],
                                  ["--layout", "split", "--gpus", "2"],  # needs two ids
                                  ["--layout", "split", "--gpus", "2,2"],
                                  ["--layout", "split", "--gpus", "2,x"],
                                  ["--runs", "ray-turbo"]])
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


# ------------------------------------------------------------------ --task reward: time to reward


def _curve(rewards: list[float], step_s: float) -> list[tuple[float, float]]:
    return [(i * step_s, r) for i, r in enumerate(rewards)]


def test_time_to_reward_reads_the_trailing_mean_not_a_lucky_step():
    from bench.gpu_bench import time_to_reward

    curve = _curve([0.1, 0.9, 0.1, 0.5, 0.6, 0.7, 0.8], step_s=2.0)
    # window 1: the lucky step 2 counts; window 3: first mean >= 0.6 is (0.5+0.6+0.7)/3 at step 6
    assert time_to_reward(curve, 0.6, window=1) == (2.0, 2)
    assert time_to_reward(curve, 0.6, window=3) == (10.0, 6)
    assert time_to_reward(curve, 0.95, window=3) is None
    assert time_to_reward(curve[:2], 0.0, window=3) is None  # no full window yet


def test_reward_threshold_is_the_level_every_run_reaches_measured_from_the_start():
    from bench.gpu_bench import reward_threshold

    slow = _curve([0.2, 0.2, 0.4, 0.6, 0.8, 0.8], 1.0)
    fast = _curve([0.2, 0.2, 0.6, 1.0, 1.0, 1.0], 0.5)
    info = reward_threshold([slow, fast], window=2, frac=0.5)
    # first 2-step means 0.2 and 0.2; highest means 0.8 and 1.0 -> the common peak is 0.8
    assert info["start"] == pytest.approx(0.2) and info["peak"] == pytest.approx(0.8)
    assert info["threshold"] == pytest.approx(0.5)
    assert reward_threshold([[], []], window=2, frac=0.5) is None
    fell = reward_threshold([_curve([0.6, 0.6, 0.2, 0.2], 1.0)], window=2, frac=0.5)
    assert fell["threshold"] == pytest.approx(fell["peak"])  # never above what every run reached


def test_mark_time_to_reward_sets_each_run_and_the_report_shows_the_ratio(tmp_path):
    from bench.gpu_bench import mark_time_to_reward

    # sync: 2 s/step; async1: the same per-step rewards at 1 s/step -> half the time
    rewards = [0.1, 0.1, 0.3, 0.5, 0.7, 0.9, 0.9, 0.9]
    runs = [RunResult("sync", True, 30.0, samples_per_s=4.0, reward_curve=_curve(rewards, 2.0)),
            RunResult("async1", True, 20.0, samples_per_s=8.0, reward_curve=_curve(rewards, 1.0)),
            RunResult("async2", False, 3.0, note="exit 1: boom")]
    info = mark_time_to_reward(runs, window=2, frac=1.0)
    assert info["threshold"] == pytest.approx(0.9)  # frac 1: the common peak itself
    assert (runs[0].time_to_reward_s, runs[0].steps_to_reward) == (12.0, 7)
    assert (runs[1].time_to_reward_s, runs[1].steps_to_reward) == (6.0, 7)
    assert runs[2].time_to_reward_s is None  # no curve: not part of the level, not reached

    args = parse_args(["--layout", "cpu", "--model", "tiny", "--task", "reward",
                       "--out", str(tmp_path)])
    text = write_report(tmp_path, runs, args, "test device", info)
    assert "s to reward (step)" in text and "| 12.0 (7) |" in text and "not reached" in text
    assert "sync/async1 = 2.00x" in text and "stopping at EOS" in text
    assert '"reward_level"' in (tmp_path / "results.json").read_text()
    assert (tmp_path / "results.png").stat().st_size > 0

    fixed = mark_time_to_reward(runs, window=2, frac=0.8, threshold=0.5)
    assert fixed["threshold"] == 0.5 and runs[0].steps_to_reward == 5  # (0.5 + 0.7) / 2 at step 5
    assert "given by --reward-threshold" in write_report(tmp_path, runs, args, "d", fixed)


def test_throughput_report_has_no_reward_column(tmp_path):
    args = parse_args(["--layout", "cpu", "--model", "tiny", "--out", str(tmp_path)])
    text = write_report(tmp_path, [RunResult("sync", True, 1.0)], args, "test device")
    assert "s to reward" not in text and "Time to" not in text


@pytest.mark.parametrize("task,ignore_eos", [("throughput", True), ("reward", False)])
def test_only_the_throughput_task_forces_fixed_length_completions(monkeypatch, tmp_path, task,
                                                                  ignore_eos):
    import yaml

    import bench.gpu_bench as gb

    seen = {}
    monkeypatch.setattr(gb, "_timed", lambda args, name, cmd, *a, **k: seen.setdefault("cmd", cmd))
    args = parse_args(["--layout", "cpu", "--task", task, "--lr", "5e-05", "--out", str(tmp_path)])
    gb.run_ours(args, "async1", "/m", tmp_path)
    cmd = seen["cmd"]
    assert ("--generation.ignore_eos" in cmd) is ignore_eos
    assert yaml.safe_load(cmd[cmd.index("--train.lr") + 1]) == 5e-05  # a float, not "5e-05"
    assert cmd[cmd.index("--train.max_staleness") + 1] == "1"


@pytest.mark.parametrize("argv", [["--task", "reward", "--trl", "colocate"],
                                  ["--reward-window", "0"], ["--reward-frac", "1.5"]])
def test_bad_reward_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_multi_producer_layouts_start_one_producer_per_gpu_entry(tmp_path, monkeypatch):
    """run_ours's command for split-3x1 (the subprocess is replaced: pure argument logic)."""
    import json

    import bench.gpu_bench as gb

    seen = {}
    monkeypatch.setattr(gb, "_timed", lambda args, name, cmd, *a, **k: seen.setdefault("cmd", cmd))
    args = parse_args(["--layout", "split-3x1", "--batch-groups", "15", "--out", str(tmp_path)])
    gb.run_ours(args, "async1", "/m", tmp_path)
    cmd = seen["cmd"]
    assert json.loads(cmd[cmd.index("--producer_gpus") + 1]) == ["0", "1", "2"]
    assert cmd[cmd.index("--num_producers") + 1] == "3"
    assert cmd[cmd.index("--learner_gpus") + 1] == "3"


def _ours_cmd(monkeypatch, tmp_path, argv: list[str], name: str) -> tuple[list[str], dict]:
    """run_ours's command, env and GPU roles (the subprocess is replaced: pure argument logic)."""
    import bench.gpu_bench as gb

    seen: dict = {}

    def fake_timed(args, name, cmd, metrics, roles, log, trl=False, env=None):
        seen.update(cmd=cmd, env=env, roles=roles)

    monkeypatch.setattr(gb, "_timed", fake_timed)
    gb.run_ours(parse_args([*argv, "--out", str(tmp_path)]), name, "/m", tmp_path)
    return seen["cmd"], seen


def test_gpus_maps_the_layout_onto_other_gpus_of_the_machine(tmp_path, monkeypatch):
    import json

    cmd, seen = _ours_cmd(monkeypatch, tmp_path, ["--layout", "split", "--gpus", "2,3"], "sync")
    assert json.loads(cmd[cmd.index("--producer_gpus") + 1]) == ["2"]
    assert cmd[cmd.index("--learner_gpus") + 1] == "3"
    assert seen["roles"] == {"generation": [2], "learner": [3]} and seen["env"] is None


def test_tensor_parallel_layout_gives_one_producer_both_gpus(tmp_path, monkeypatch):
    import json

    cmd, _ = _ours_cmd(monkeypatch, tmp_path, ["--layout", "split-tp2"], "async1")
    assert json.loads(cmd[cmd.index("--producer_gpus") + 1]) == ["0,1"]
    assert cmd[cmd.index("--engine.tensor_parallel_size") + 1] == "2"
    assert cmd[cmd.index("--num_producers") + 1] == "1"
    assert cmd[cmd.index("--learner_gpus") + 1] == "2"


def test_a_ray_run_lets_ray_place_the_gpus_the_layout_names(tmp_path, monkeypatch):
    cmd, seen = _ours_cmd(monkeypatch, tmp_path, ["--layout", "split", "--gpus", "2,3"],
                          "ray-async1")
    assert cmd[cmd.index("--launcher") + 1] == "ray"
    assert "--producer_gpus" not in cmd and "--learner_gpus" not in cmd
    assert "launch.learner_num_gpus=1" in cmd and "launch.producer_num_gpus=1" in cmd
    assert cmd[cmd.index("--train.mode") + 1] == "async"
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "2,3" and seen["roles"] == {}


def test_the_report_gives_ray_over_local_ratios(tmp_path):
    args = parse_args(["--runs", "async1,ray-async1", "--out", str(tmp_path)])
    results = [RunResult("async1", True, 10.0, samples_per_s=40.0),
               RunResult("ray-async1", True, 10.0, samples_per_s=38.0)]
    text = write_report(tmp_path, results, args, "test")
    assert "ray-async1/async1 = 0.95x" in text


# ------------------------------------------------------------------ TRL's GPUs, SIGTERM, reports


@pytest.mark.parametrize("layout,trl,expect", [
    ("split", "server", {"--trainer-gpus": "0", "--server-gpus": "1"}),
    ("colocated", "colocate", {"--trainer-gpus": "0", "--server-gpus": None}),
    ("cpu", "colocate", {"--trainer-gpus": None, "--server-gpus": None}),
    ("split --gpus 2,3", "server", {"--trainer-gpus": "2", "--server-gpus": "3"})])
def test_the_trl_trainer_sees_only_its_own_gpu(tmp_path, monkeypatch, layout, trl, expect):
    """Seeing both GPUs, transformers sets n_gpu=2 and GRPOTrainer refuses DataParallel."""
    import bench.gpu_bench as gb

    seen = {}
    monkeypatch.setattr(gb, "_timed", lambda args, name, cmd, *a, **k: seen.setdefault("cmd", cmd))
    args = parse_args(["--layout", *layout.split(), "--trl", trl, "--out", str(tmp_path)])
    gb.run_trl(args, f"trl-{trl}", "/m", tmp_path)
    cmd = seen["cmd"]
    for flag, value in expect.items():
        assert (cmd[cmd.index(flag) + 1] if flag in cmd else None) == value


def test_sigterm_stops_the_runs_process_group_before_the_bench_exits(tmp_path):
    """`timeout` SIGTERMs gpu_bench alone; its handler must still stop the run's group (which
    sits in a session of its own) instead of leaving it on the GPU."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    pidfile = tmp_path / "child.pid"
    run = (f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
           f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    bench = ("import signal, sys; import bench.gpu_bench as gb; "
             "signal.signal(signal.SIGTERM, gb._exit_on_sigterm); "
             f"gb.run_group([sys.executable, '-c', {run!r}], open({str(tmp_path / 'log')!r}, 'w'), "
             "timeout=300, interrupted_grace=2)")
    proc = subprocess.Popen([sys.executable, "-c", bench], cwd=Path(__file__).parents[3])
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_the_report_is_rewritten_after_each_run_and_marks_a_cut_one(tmp_path, monkeypatch):
    import bench.gpu_bench as gb

    def fake_run(args, name, model, out):
        if name == "async1":
            assert "| sync | 10.0 |" in (out / "results.md").read_text()  # written already
            raise SystemExit(143)  # what the SIGTERM handler raises
        return RunResult(name, True, 5.0, samples_per_s=10.0)

    monkeypatch.setattr(gb, "run_ours", fake_run)
    with pytest.raises(SystemExit):
        gb.main(["--layout", "cpu", "--model", "tiny", "--runs", "sync,async1",
                 "--out", str(tmp_path)])
    text = (tmp_path / "results.md").read_text()
    assert "| sync | 10.0 |" in text and "FAILED stopped by signal (exit 143)" in text
    assert (tmp_path / "results.png").exists()


def test_a_gpu_in_both_roles_is_footnoted_in_the_busy_columns(tmp_path):
    class Sampler:
        def busy(self, gpu, t0, t1):
            return {0: 0.9, 1: 0.5}[gpu]

    rows = _rows(6, 1.0)
    shared = summarize("async1", rows, 10.0, 1, 8, Sampler(),
                       {"generation": [0, 1], "learner": [1]})  # split-shared
    assert shared.shared_gpus == [1] and shared.gpu_busy == {"generation": 0.7, "learner": 0.5}
    split = summarize("sync", rows, 10.0, 1, 8, Sampler(), {"generation": [0], "learner": [1]})
    assert split.shared_gpus == []
    args = parse_args(["--layout", "cpu", "--model", "tiny", "--out", str(tmp_path)])
    text = write_report(tmp_path, [split, shared], args, "test device")
    assert "| 0.7* | 0.5* |" in text and "| 0.9 | 0.5 |" in text
    assert "GPU 1 in async1" in text and "both busy columns" in text
    plain = write_report(tmp_path, [split], args, "test device")
    assert "*" not in plain.replace("**", "")
