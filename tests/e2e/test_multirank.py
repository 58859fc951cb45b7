"""The learner on 2 CPU processes through `accelerate launch` (gloo): a 2-rank step has the
single-rank gradient, and a full run (1 producer, real vLLM CPU engine) finishes its steps.

This file is also the per-rank script of the gradient test: ``accelerate launch ... THIS_FILE
--grads OUT.pt MODEL_DIR`` saves rank 0's gradients on a fixed batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script by accelerate launch
    sys.path.insert(0, str(REPO))


def _grads(model_dir: str, out: str, micro_batch: int) -> None:
    """Per-rank: gradients of the batch loss on a fixed batch; rank 0 saves them."""
    import numpy as np
    import torch

    from buffer.schema import Completion, RolloutGroup
    from pipeline.config import load_config
    from pipeline.learner import distributed as D
    from pipeline.learner.trainer import PolicyTrainer

    rng = np.random.default_rng(0)
    groups = []
    for gid, plen, lens in (("a", 5, [3, 6, 1, 4]), ("b", 8, [2, 5, 7, 3]),
                            ("c", 4, [9, 1, 2, 6])):
        comps = [Completion(token_ids=rng.integers(32, 127, size=t).astype(np.int32),
                            logprobs=(-rng.random(t) - 0.1).astype(np.float32),
                            version_segments=[(0, 0)], reward=float(rng.random()))
                 for t in lens]
        groups.append(RolloutGroup(group_id=gid, producer_id="p0", prompt_id=gid,
                                   prompt_token_ids=rng.integers(32, 127, size=plen)
                                   .astype(np.int32), completions=comps))
    cfg = load_config(overrides={"model.path": model_dir, "data.path": "arithmetic:10",
                                 "model.dtype": "float32", "train.micro_batch": micro_batch,
                                 "generation.group_size": 4})
    tr = PolicyTrainer(cfg, model_dir, device="cpu")
    if D.is_main():
        metrics = tr.accumulate_gradients(groups)
        grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()
                 if p.grad is not None}
        torch.save({"grads": grads, "metrics": metrics, "world": tr.world}, out)
        tr.release_followers()
    else:
        tr.follow()




def _accelerate(n: int, *args: str, timeout: float, env: dict | None = None
                ) -> subprocess.CompletedProcess:
    # --multi_gpu picks accelerate's torchrun launcher; Accelerator(cpu=True) then runs gloo
    # (accelerate's --cpu launcher would start one process, or need mpirun, for N > 1).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n),
           *(["--multi_gpu"] if n > 1 else ["--cpu"]), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env or dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_two_rank_gradient_equals_single_rank_gradient(tiny_model, tmp_path):
    import torch

    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    # micro_batch 2: several micro-batches per rank (no_sync accumulation) and uneven slices.
    _accelerate(1, __file__, "--grads", str(one), str(tiny_model), timeout=300)
    _accelerate(2, __file__, "--grads", str(two), str(tiny_model), timeout=300)
    a, b = torch.load(one), torch.load(two)
    assert (a["world"], b["world"]) == (1, 2)
    assert set(a["grads"]) == set(b["grads"]) and a["grads"]
    for name, g in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert b["metrics"]["loss"] == pytest.approx(a["metrics"]["loss"], rel=1e-4)


def test_learner_on_two_processes_runs_to_the_end(tiny_model, tmp_path):
    run_dir = tmp_path / "multirank"
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(tiny_model),
           "--data", "arithmetic:200", "--reward", "pipeline.tasks.rewards:length_reward",
           "--num-producers", "1", "--batch-groups", "2", "--group-size", "4",
           "--max-tokens", "8", "--run-dir", str(run_dir), "--steps", "2",
           "--engine.max_model_len", "256", "--engine.cpu_kvcache_space_gib", "1",
           "--tensorboard", "false", "--train.learner_processes", "2"]
    tag = f"multirank{os.getpid()}"
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PIPELINE_TEST_RUN=tag))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Not at module level: this file is also the ranks' script.
    from conftest import assert_no_process_left

    from tests.e2e.support.launcher import read_metrics

    assert_no_process_left(tag)  # accelerate's launcher and both ranks are gone
    rows = read_metrics(run_dir)
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["learner_processes"] == 2 for r in rows)
    assert all(r["skipped_nonfinite"] == 0 for r in rows)
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text().strip()
    assert json.loads((ckpt / "state.json").read_text())["step"] == 2


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--grads", required=True)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("model")
    a = p.parse_args()
    from tests.e2e.support.ranks import end_rank

    _grads(a.model, a.grads, a.micro_batch)
    end_rank()
