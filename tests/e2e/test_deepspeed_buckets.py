"""Weights out of a ZeRO-3 learner bucket by bucket (2 CPU ranks, DS_ACCELERATOR=cpu, gloo):
``snapshot_buckets`` (one GatheredParameters all-gather per bucket, the other rank in step
through the "buckets" command) packs exactly the weights the whole-model gather gives, before
and after an optimiser step, with buckets far smaller than the model; ``LearnerRoutes.capture`` does
so into host memory, and the snapshot file written from it reads back as those weights.

This file is also the per-rank script: ``accelerate launch ... THIS_FILE OUT_DIR MODEL``.
"""

from __future__ import annotations

import importlib.util
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


def _compare(tr, out: Path, tag: str) -> dict:
    """Rank 0: the whole-model snapshot against the bucketed capture (tiny buckets)."""
    from types import SimpleNamespace

    import torch

    from pipeline.learner.routes import LearnerRoutes
    from sync.packing import (
        pack_buckets,
        plan_buckets,
        plan_layout_of,
        total_bytes,
        unpack,
    )
    from sync.snapshot import read_snapshot, write_packed

    whole = tr.snapshot_tensors()
    plan = tr.snapshot_plan()
    layout = plan_layout_of(plan)
    bucket_bytes = 64 << 10
    flat = torch.empty(total_bytes(layout), dtype=torch.uint8)
    n = pack_buckets(tr.snapshot_buckets(bucket_bytes), layout, flat)
    views = unpack(flat, layout)
    me = SimpleNamespace(trainer=tr, copies=None, live_gpu_routes=lambda: {}, counters={},
                         cfg=SimpleNamespace(sync=SimpleNamespace(bucket_mb=1, host_copies=None)))
    cflat, clayout = LearnerRoutes.capture(me, 1)
    ref = write_packed(cflat, clayout, 1, out / f"snap_{tag}")
    from_file = read_snapshot(ref)
    return {"whole": whole, "bucketed": {k: v.clone() for k, v in views.items()},
            "file": from_file, "buckets": n, "planned": len(plan_buckets(layout, bucket_bytes)),
            "plan": {k: (str(d), s) for k, (d, s) in plan.items()},
            "capture_device": str(cflat.device)}


def _run(out: Path, model_dir: str) -> None:
    import torch
    from test_deepspeed import batch, own_logprobs

    from pipeline.config import load_config
    from pipeline.learner import distributed as D
    from pipeline.learner.trainer import PolicyTrainer

    batches = []
    if D.is_main():  # before the trainer: after it, ZeRO-3 makes from_pretrained a collective
        batches = [batch(1)]
        own_logprobs(batches, model_dir)
    cfg = load_config(overrides={
        "model.path": model_dir, "data.path": "arithmetic:10", "model.dtype": "float32",
        "train.micro_batch": 2, "generation.group_size": 4, "train.lr": 1e-2,
        "run_dir": str(out / "run")})
    tr = PolicyTrainer(cfg, model_dir)
    if D.is_main():
        res = {"zero_stage": tr.zero_stage, "world": tr.world, "before": _compare(tr, out, "0")}
        res["step"] = tr.step(batches[0], 0)
        res["after"] = _compare(tr, out, "1")
        torch.save(res, out / "buckets.pt")
        tr.release_followers()
    else:
        tr.follow()


def test_zero3_bucketed_snapshot_equals_the_whole_gather(tiny_model, tmp_path):
    import torch

    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "examples" / "accelerate" / "zero3.yaml"), "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no",
           "--main_process_port", str(free_port()), __file__, str(tmp_path),
           str(tiny_model)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    (tmp_path / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = torch.load(tmp_path / "buckets.pt")
    assert (res["zero_stage"], res["world"]) == (3, 2)
    assert res["step"]["skipped_nonfinite"] == 0
    for phase in ("before", "after"):
        r = res[phase]
        assert r["buckets"] == r["planned"] > 3, phase  # many buckets, each gathered in turn
        assert r["capture_device"] == "cpu"
        assert list(r["whole"]) == list(r["bucketed"]), phase  # same names, same order
        assert set(r["file"]) == set(r["whole"]), phase
        for name, t in r["whole"].items():
            assert r["plan"][name][1] == tuple(t.shape), name
            assert torch.equal(r["bucketed"][name], t), (phase, name)
            assert torch.equal(r["file"][name], t), (phase, name)
    # The step changed the weights, and the buckets saw the new partitions.
    changed = [k for k, v in res["after"]["whole"].items()
               if not torch.equal(v, res["before"]["whole"][k])]
    assert changed


if __name__ == "__main__":
    from tests.e2e.support.ranks import end_rank

    _run(Path(sys.argv[1]), sys.argv[2])
    end_rank()
