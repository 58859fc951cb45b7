"""A DeepSpeed learner of 2 CPU ranks (ZeRO-2, gloo) whose checkpoint write fails on one rank:
every rank learns it (rank 0 raises one CheckpointError naming the rank and its error, the
follower logs it and goes on following), no rank is left in a collective the other skipped, and
the next checkpoint and the next training step run in step on both ranks.

The failure is real I/O: rank 1's optimiser-state file cannot be created, as a directory of that
name already stands where DeepSpeed writes it.

This file is also the per-rank script: ``accelerate launch ... THIS_FILE OUT_DIR MODEL``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install deepspeed; DS_BUILD_OPS=0 is enough)")]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (REPO, HERE):  # run as a script by accelerate launch
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _run(out: Path, model_dir: str) -> None:
    from test_deepspeed import batch

    from pipeline.config import load_config
    from pipeline.learner import distributed as D
    from pipeline.learner.checkpoint import CheckpointError
    from pipeline.learner.trainer import PolicyTrainer

    cfg = load_config(overrides={
        "model.path": model_dir, "data.path": "arithmetic:10", "model.dtype": "float32",
        "train.micro_batch": 2, "generation.group_size": 4, "run_dir": str(out / "run")})
    tr = PolicyTrainer(cfg, model_dir)
    if not D.is_main():
        tr.follow()
        return
    res: dict = {"zero_stage": tr.zero_stage}
    tr.save_shards(out / "a")
    files = sorted(p.name for p in (out / "a").rglob("*") if p.is_file())
    res["files_a"] = files
    rank1 = [f for f in files if "rank_1" in f]
    obstacle = next((out / "a").rglob(rank1[0])).relative_to(out / "a")
    (out / "b" / obstacle).mkdir(parents=True)  # rank 1 cannot create its file there
    try:
        tr.save_shards(out / "b")
        res["b"] = "written"
    except CheckpointError as e:
        res["b"] = str(e)
    tr.save_shards(out / "c")
    res["files_c"] = sorted(p.name for p in (out / "c").rglob("*") if p.is_file())
    res["step_skipped"] = tr.step(batch(1), 0)["skipped_nonfinite"]
    (out / "result.json").write_text(json.dumps(res))
    tr.release_followers()


def test_a_checkpoint_failing_on_one_rank_leaves_every_rank_in_step(tiny_model, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "examples" / "accelerate" / "zero2.yaml"), "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no",
           "--main_process_port", str(free_port()), __file__, str(tmp_path), str(tiny_model)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    (tmp_path / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["zero_stage"] == 2
    # Rank 1 failed, rank 0 did not; rank 0 says so in one line.
    assert res["b"].startswith("rank 1: ") and "rank 0" not in res["b"], res["b"]
    assert "\n" not in res["b"]
    # The next checkpoint is every rank's files again, and training goes on.
    assert res["files_c"] == res["files_a"] and any("rank_1" in f for f in res["files_c"])
    assert res["step_skipped"] == 0


if __name__ == "__main__":
    from tests.e2e.support.ranks import end_rank

    _run(Path(sys.argv[1]), sys.argv[2])
    end_rank()
