"""A disk that fills up mid-run (a real filesystem: a 32 MB tmpfs mounted on the run's
checkpoints directory, filled by the test once the first checkpoint is saved): the failed write
is one console line, its partial directory is removed, ``LATEST`` keeps naming the previous
checkpoint, training goes on (``train.on_checkpoint_error: continue``), and once space is back
the run writes its later checkpoints; stopped by Ctrl-C, it writes its final one and loses no
group. And the whole run_dir on a small filesystem filled mid-run: generation pauses (one
console line) and resumes once the filler is gone, and the run ends as planned.
Real `pipeline-train` runs (vLLM CPU engine, tiny model)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time

import pytest

from bench.soak import tally
from pipeline.learner.checkpoint import load_checkpoint
from tests.e2e.support.launcher import ENGINE_START_S, Launcher, read_metrics
from tests.small_fs import fill, small_filesystem

pytestmark = pytest.mark.slow

FAILED = re.compile(r"checkpoint at step (\d+) failed \(.*No space left on device.*\); the "
                    r"previous checkpoint (\S+) is intact; training goes on")


def test_a_full_disk_mid_run_is_one_line_and_the_run_goes_on(tiny_model, tmp_path):
    """The run has no last step of its own: each phase waits for its event (the first
    checkpoint, the failure line, a checkpoint written once space is back), then Ctrl-C ends it
    with its final checkpoint; no assertion depends on how many steps a phase took."""
    run_dir = tmp_path / "full"
    ckpts = run_dir / "checkpoints"
    with small_filesystem(ckpts, 32):
        la = Launcher(tiny_model, run_dir, "--mode", "async", "--max-staleness", "1",
                      "--steps", "100000", "--num-producers", "1",
                      "--train.checkpoint_every", "1", "--train.keep_checkpoints", "2")
        filler = ckpts / "filler"

        def latest_step() -> int:
            """The step of the checkpoint LATEST names (step_N, or step_N-K for one rewritten
            at the same step), 0 before the first."""
            with contextlib.suppress(OSError):
                m = re.fullmatch(r"step_(\d+)(-\d+)?", (ckpts / "LATEST").read_text().strip())
                return int(m[1]) if m else 0
            return 0

        try:
            la.wait_for(lambda: latest_step() > 0, ENGINE_START_S, "the first checkpoint")
            free = shutil.disk_usage(ckpts).free
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                f.write(b"\0" * (free - 65536))  # leave 64 KB: no checkpoint fits
            failed = la.wait_for(lambda: [m for ln in la.lines if (m := FAILED.search(ln))],
                                 300, "the failed checkpoint's console line")
            step = int(failed[0][1])
            filler.unlink()  # space is back: the next checkpoints are written
            la.wait_for(lambda: latest_step() > step, 300, "a checkpoint after the failed one")
        finally:
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()
            la.stop()  # Ctrl-C: the learner's final checkpoint, then every process stops
        assert la.proc.returncode == 130, la.tail()
        previous = failed[0][2]
        assert re.search(r"/checkpoints/step_(\d+)$", previous), previous
        assert int(previous.rsplit("_", 1)[1]) < step  # an older, complete checkpoint
        assert not any(p.name.startswith(".tmp_step_") for p in ckpts.iterdir())
        rows = read_metrics(run_dir)
        last = rows[-1]["step"]
        assert [r["step"] for r in rows] == list(range(1, last + 1))
        assert last > step and rows[-1]["checkpoint_failures"] >= 1
        # The free-space figure is the checkpoints' 32 MB filesystem's (not run_dir's), and
        # moves with what is written there.
        free_gb = [r["checkpoint_disk_free_gb"] for r in rows if "checkpoint_disk_free_gb" in r]
        assert all(0 <= f < 0.04 for f in free_gb) and min(free_gb) < free_gb[0], free_gb
        assert next(r for r in rows if r.get("checkpoint_failures", 0) >= 1)["step"] >= step
        # The final checkpoint holds the last step, which has its row, and LATEST names it.
        assert latest_step() == last, (sorted(p.name for p in ckpts.iterdir()), last)
        state, _tensors, _buffer = load_checkpoint(ckpts / (ckpts / "LATEST").read_text().strip())
        assert state.step == last
        assert "final checkpoint " in la.stdout, la.stdout
        # Nothing lost: every group sent is trained, dropped (by reason) or held.
        t = tally(run_dir)
        assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
        assert not os.path.exists(filler)


PAUSED = "run_dir's disk is full: generation paused; free space to continue"
ABOUT_IT = re.compile(r"disk|space|full|ENOSPC|Logging error", re.IGNORECASE)


def test_a_full_run_dir_pauses_generation_and_the_run_finishes(tiny_model, tmp_path):
    """The whole run_dir on a 48 MB filesystem, filled once the learner has trained 2 steps
    and freed 5 s after the producer says it paused: the run trains its last step and exits 0,
    no group is lost, and the console shows at most 3 lines about it and no traceback."""
    run_dir = tmp_path / "run"
    with small_filesystem(run_dir, 48):
        la = Launcher(tiny_model, run_dir, "--mode", "async", "--max-staleness", "1",
                      "--steps", "8", "--num-producers", "1",
                      "--train.checkpoint_every", "1", "--train.keep_checkpoints", "1",
                      verbose=False)
        filler = run_dir / "filler"
        try:
            la.wait_for(lambda: la.steps_done() >= 2, ENGINE_START_S, "step 2")
            fill(filler)
            la.wait_for(lambda: any(PAUSED in ln for ln in la.lines), 120, "the pause line")
            time.sleep(5)  # the learner trains what it holds and skips its checkpoints
            filler.unlink()
            rc = la.wait(300)
        finally:
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()
            la.stop()
        console = la.stdout.splitlines() + la.lines
        about = [ln for ln in console if ABOUT_IT.search(ln.replace(str(tmp_path), ""))]
        assert rc == 0, la.tail()
        assert [ln for ln in about if PAUSED in ln] and len(about) <= 3, "\n".join(console)
        assert not [ln for ln in console if "Traceback" in ln], la.tail()
        print("console lines about the full disk:", *about, sep="\n  ")
        rows = [r for r in read_metrics(run_dir) if "reward_mean" in r]
        assert [r["step"] for r in rows] == list(range(1, 9))  # rows that waited, written
        last = rows[-1]
        # Generation waited (a pause, its seconds), and the lines the log files could not
        # take were counted, not printed.
        assert last["producer/disk_full_pauses"] >= 1 and last["producer/disk_full_s"] > 1, last
        assert last["producer/log_lines_dropped"] >= 1, last
        assert "line(s) of this process's output were dropped here" in \
            (run_dir / "logs" / "producer-0.log").read_text()
        t = tally(run_dir)
        assert t["lost"] == 0 and t["conservation_ok"] and t["buffer_invariant_ok"], t
        assert t["steps"] == 8, t
