"""A launcher killed with -9 together with everything it started (as a job scheduler or the OOM
killer may do) cleans up nothing: its learner's /dev/shm snapshot directory and its engines'
``psm_*`` segments stay. The next run on the machine reclaims them and says how much it freed;
that run (--verbose) also shows every process's log, the engine's included, on the console.
Real `pipeline-train` runs (vLLM CPU engines, tiny model)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from pipeline.launch.shm import SHM_DIR, list_segments
from pipeline.owner import owner_tag
from tests.e2e.support.launcher import VLLM_RECORD, Launcher

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]


def _owned_by(tag: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"pipeline-grpo-*.owner-{tag}"))


def test_leftovers_of_a_killed_launcher_are_reclaimed_by_the_next_run(tiny_model, tmp_path,
                                                                     monkeypatch):
    # vLLM's multiprocess executor (a worker process beside the engine core, talking through
    # psm_* segments): what an engine over several ranks runs; a one-rank CPU engine keeps its
    # worker in the core and has no such segments (``pipeline.producer.engine.build_engine``).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    shm_before = list_segments()
    la = Launcher(tiny_model, tmp_path / "killed", "--mode", "async", "--steps", "100000",
                  "--num-producers", "1")
    tag = owner_tag(la.proc.pid)
    try:
        la.wait_for(lambda: la.steps_done() >= 1, 600, "the first step")
        record = SHM_DIR / f"pipeline-grpo-segments.owner-{tag}"
        la.wait_for(
            lambda: record.exists() and record.read_text().split(),
            60,
            "the launcher's record of its engines' segments",
        )
        every = [la.proc.pid] + [
            c.pid for c in psutil.Process(la.proc.pid).children(recursive=True)
        ]
        for pid in every:  # the whole job at once: nobody gets to clean up
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        la.proc.wait(30)
        psutil.wait_procs([p for p in map(_proc, every) if p], timeout=30)
    finally:
        la.stop()
    left = _owned_by(tag)
    snapshot_dirs = [p for p in left if p.is_dir()]
    segments = set(record.read_text().split()) & list_segments()
    assert snapshot_dirs and segments, (left, segments)

    la = Launcher(
        tiny_model,
        tmp_path / "next",
        "--mode",
        "sync",
        "--steps",
        "1",
        "--num-producers",
        "1",
        "--batch-groups",
        "1",
    )
    try:
        assert la.wait(300) == 0, la.tail()
    finally:
        la.stop()
    log = "\n".join(la.lines)
    # --verbose (the Launcher's): every process's log on the console, the engine's included.
    assert len([x for x in log.splitlines() if VLLM_RECORD.search(x)]) >= 10, log[-3000:]
    assert re.search(r"\(EngineCore\S* pid=\d+\) INFO", log)
    assert "connected at version 0" in log and "reward: first" in la.stdout, la.stdout
    m = re.search(
        r"reclaimed ([\d.]+) MB in /dev/shm left by killed runs: (\d+) snapshot "
        r"dir\(s\), (\d+) engine segment\(s\)",
        log,
    )
    assert m, log[-3000:]
    # Every run reclaims what any dead run left, so a run of another test suite on this machine
    # may take some of these first: what must hold is that the next run reclaims and all is gone.
    assert int(m[2]) >= 1 and int(m[3]) >= 1
    assert float(m[1]) > 0
    assert _owned_by(tag) == []
    assert not segments & list_segments()
    assert (list_segments() - shm_before) & segments == set()


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
