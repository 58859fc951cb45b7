"""A multi-rank learner whose final checkpoint failed ends at once with code 1 (no further
collective, which could hang until the process group's timeout): ``end_every_rank`` in a real
child process."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
from pipeline.procs import setup_logging
setup_logging()
from pipeline.learner.main import end_every_rank
end_every_rank()
print("not reached", flush=True)
"""


def test_end_every_rank_exits_1_at_once_with_one_line():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, WORLD_SIZE="2"))
    assert done.returncode == 1, done
    assert "not reached" not in done.stdout
    out = done.stdout + done.stderr
    assert "final checkpoint failed on a learner of 2 ranks: ending every rank now" in out, out
