"""A disk that fills up mid-run (a real filesystem: a 32 MB tmpfs mounted on the run's
checkpoints directory, filled by the test once the first checkpoint is saved): the failed write
is one console line, its partial directory is removed, ``LATEST`` keeps naming the previous
checkpoint, training goes on (``train.on_checkpoint_error: continue``), and once space is back
the run writes its later checkpoints and reaches its last step with no group left behind.
Real `pipeline-train` run (vLLM CPU engine, tiny model)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

import pytest

from pipeline.learner.checkpoint import load_checkpoint
from tests.e2e.support.launcher import ENGINE_START_S, Launcher, read_metrics

pytestmark = pytest.mark.slow

FAILED = re.compile(r"checkpoint at step (\d+) failed \(.*No space left on device.*\); the "
                    r"previous checkpoint (\S+) is intact; training goes on")


@contextlib.contextmanager
def small_filesystem(path, megabytes: int):
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root; the "
                    "injected-ENOSPC unit tests (test_checkpoint_background.py) cover the logic")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_mid_run_is_one_line_and_the_run_goes_on(tiny_model, tmp_path):
    run_dir = tmp_path / "full"
    ckpts = run_dir / "checkpoints"
    steps = 10
    with small_filesystem(ckpts, 32):
        la = Launcher(tiny_model, run_dir, "--mode", "async", "--max-staleness", "1",
                      "--steps", str(steps), "--num-producers", "1",
                      "--train.checkpoint_every", "1", "--train.keep_checkpoints", "2")
        filler = ckpts / "filler"
        try:
            la.wait_for(lambda: (ckpts / "LATEST").exists(), ENGINE_START_S,
                        "the first checkpoint")
            free = shutil.disk_usage(ckpts).free
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                f.write(b"\0" * (free - 65536))  # leave 64 KB: no checkpoint fits
            failed = la.wait_for(lambda: [m for ln in la.lines if (m := FAILED.search(ln))],
                                 300, "the failed checkpoint's console line")
            filler.unlink()  # space is back: the next checkpoints are written
            code = la.wait(ENGINE_START_S)
        finally:
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()
            la.stop()
        assert code == 0, la.tail()
        step, previous = int(failed[0][1]), failed[0][2]
        assert re.search(r"/checkpoints/step_(\d+)$", previous), previous
        assert int(previous.rsplit("_", 1)[1]) < step  # an older, complete checkpoint
        assert not any(p.name.startswith(".tmp_step_") for p in ckpts.iterdir())
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        assert rows[-1]["checkpoint_failures"] >= 1
        free_gb = [r["checkpoint_disk_free_gb"] for r in rows]  # the tmpfs's, not run_dir's
        assert all(0 <= f < 0.04 for f in free_gb) and min(free_gb) < 0.001, free_gb
        # After the space came back: the final checkpoint is written and LATEST names it.
        latest = (ckpts / "LATEST").read_text().strip()
        assert latest == f"step_{steps}", latest
        state, _tensors, _buffer = load_checkpoint(ckpts / latest)
        assert state.step == steps
        assert "not delivered" not in la.stdout + "\n".join(la.lines)  # no group left behind
        assert "final checkpoint " in la.stdout, la.stdout
        assert not os.path.exists(filler)
