"""bench/run_gpu.sh's helpers, sourced with RUN_GPU_LIB=1 (no part runs): what a part leaves
under $OUT fits what the device returns (8 files, 2 folders deep), and the call's time budget."""

from __future__ import annotations

import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "run_gpu.sh"


def _sh(snippet: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source {SCRIPT} && {snippet}"], cwd=out.parent,
                          env={"PATH": "/usr/bin:/bin", "RUN_GPU_LIB": "1", "OUT": str(out), **env},
                          capture_output=True, text=True, timeout=60)


def _fake_part(part: Path, runs: list[str]) -> None:
    """What gpu_bench leaves: the report, a log per run, run dirs, TRL's JSON and server log."""
    for name in ("results.md", "results.json", "results.png"):
        (part / name).parent.mkdir(parents=True, exist_ok=True)
        (part / name).write_text(name)
    for run in runs:
        (part / f"{run}.log").write_text(f"{run} log\n")
        (part / run / "checkpoints" / "step_2").mkdir(parents=True)
        (part / run / "checkpoints" / "step_2" / "model.safetensors").write_text("big")
        (part / run / "producers").mkdir()
        (part / run / "producers" / "p0.jsonl").write_text("{}\n")
        (part / run / "metrics.jsonl").write_text(f'{{"step": 1, "run": "{run}"}}\n')
        (part / run / "config.yaml").write_text("a: 1\n")
    (part / "trl-server.json").write_text("{}")
    (part / "trl-server.server.log").write_text("ValueError: the root cause\n")
    (part / "trl-server.trl" / "runs").mkdir(parents=True)
    (part / "trl-server.trl" / "runs" / "events").write_text("x")


def test_pack_keeps_report_logs_and_metrics_within_eight_files(tmp_path):
    out = tmp_path / "out"
    _fake_part(out / "split", ["sync", "async1"])
    res = _sh("pack split", out)
    assert res.returncode == 0, res.stderr
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["split/async1.metrics.jsonl", "split/results.json", "split/results.md",
                     "split/results.png", "split/split-logs.tgz", "split/sync.metrics.jsonl"]
    with tarfile.open(out / "split" / "split-logs.tgz") as tar:
        names = set(tar.getnames())
        root_cause = tar.extractfile("./trl-server.server.log").read()
    assert {"./sync.log", "./async1.log", "./trl-server.json", "./sync/metrics.jsonl",
            "./sync/config.yaml"} <= names
    assert b"root cause" in root_cause
    assert not any("checkpoints" in n or "producers" in n or ".trl" in n for n in names)


def test_pack_drops_flat_metrics_that_do_not_fit(tmp_path):
    out = tmp_path / "out"
    (out / "engine.log").parent.mkdir(parents=True)
    (out / "engine.log").write_text("another part's file, same call\n")
    _fake_part(out / "many", [f"r{i}" for i in range(6)])
    assert _sh("pack many", out).returncode == 0
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) == 8  # engine.log + results x3 + tgz + 3 of the 6 metrics copies
    assert (out / "many" / "many-logs.tgz").exists() and (out / "many" / "results.md").exists()
    with tarfile.open(out / "many" / "many-logs.tgz") as tar:  # all six are in the tarball
        assert sum(n.endswith("/metrics.jsonl") for n in tar.getnames()) == 6


def test_budget_is_what_is_left_of_the_call_and_refuses_under_a_minute(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    t0 = int(time.time())
    assert _sh("budget 120", out, CALL_T0=str(t0)).stdout.strip() == "120"
    left = int(_sh("budget 600", out, CALL_T0=str(t0 - 500)).stdout.strip())
    assert 60 <= left <= 70  # 570 - 500, less the time this took
    late = _sh("budget 300", out, CALL_T0=str(t0 - 530))
    assert late.returncode != 0 and "left in this call" in late.stderr


def test_without_call_t0_the_budget_counts_from_the_scripts_start(tmp_path):
    """Not from the parent process: under a long-lived runner (pytest here, the device's agent
    there) that guess made the budget negative and every part refused to run."""
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run(["bash", "-c", f"sleep 2; RUN_GPU_LIB=1 OUT={out} bash -c "
                          f"'source {SCRIPT} && left'"], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert 565 <= int(res.stdout.strip()) <= 570


def test_the_trl_async_part_runs_ours_async1_and_trl_async_on_the_split_layout(tmp_path):
    """The part's commands, with python3 replaced by a recorder (mock: no GPU, no bench)."""
    out, bin_dir = tmp_path / "out", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    r = subprocess.run(["bash", str(SCRIPT), "trl-async"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out),
                            "CALLS": str(calls), "MODEL": "3b", "GPUS": "2,3"})
    assert r.returncode == 0, r.stderr
    check, bench = calls.read_text().splitlines()
    assert "import aiohttp, requests, trl" in check
    args = bench.split()
    assert args[:2] == ["-m", "bench.gpu_bench"]
    for flag, value in {"--layout": "split", "--runs": "async1", "--trl": "async",
                        "--model": "3b", "--gpus": "2,3", "--out": f"{out}/trl-async"}.items():
        assert args[args.index(flag) + 1] == value


def _python3_stand_in(tmp_path: Path, body: str) -> str:
    """A ``python3`` on PATH that runs ``body`` instead of pytest (named so: a stand-in)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\necho 'pytest output'\n{body}\n")
    (bin_dir / "python3").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_gpu_tests_keeps_the_log_and_counts_a_failed_or_cut_run_stand_in_pytest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ok = _sh('gpu_tests 30 a tests/x.py; echo "failed=${failed[*]}"', out,
             PATH=_python3_stand_in(tmp_path, "exit 0"))
    assert ok.returncode == 0 and "failed=\n" in ok.stdout, ok.stderr
    assert (out / "a.log").read_text() == "pytest output\n"
    (tmp_path / "bin" / "python3").write_text("#!/bin/sh\nexit 1\n")
    bad = _sh('gpu_tests 30 a tests/x.py; echo "failed=${failed[*]}"', out,
              PATH=str(tmp_path / "bin") + ":/usr/bin:/bin")
    assert "failed=a\n" in bad.stdout and "gpu tests 'a' exited 1" in bad.stderr
    (tmp_path / "bin" / "python3").write_text("#!/bin/sh\nsleep 5\n")
    cut = _sh('gpu_tests 1 c tests/z.py; echo "failed=${failed[*]}"', out,
              PATH=str(tmp_path / "bin") + ":/usr/bin:/bin")
    assert "failed=c\n" in cut.stdout and "gpu tests 'c' cut at 1 s" in cut.stderr
