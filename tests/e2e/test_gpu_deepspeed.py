"""DeepSpeed ZeRO-2/3 learners on 2 GPUs (skipped on CPU machines; run them on the device tool,
see README "DeepSpeed"): the shipped accelerate configs as they are (bf16), on a Qwen2-0.5B-shaped
random model (tied embeddings, real ZeRO-3 partitioning and zero3_init_flag loading).

- trainer level (the per-rank script of test_deepspeed.py): the snapshot is the full model (HF
  names and shapes, values gathered from the ZeRO-3 partitions), a checkpoint holds both ranks'
  optimiser partitions, and a resumed step equals the uninterrupted one on every rank's
  optimiser state;
- the product: `pipeline-train` with a ZeRO-3 (or plain DDP) learner on both GPUs and one vLLM
  producer beside rank 0 on GPU 0, then `--resume`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_process_left
from test_deepspeed import (
    ZERO_CONFIGS,
    check_full_snapshot,
    check_resume_equals_uninterrupted,
    launch,
    optim_states,
)

from tests.e2e.support.launcher import read_metrics


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed"),
              pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_05b(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "qwen2-0.5b-random"
    subprocess.run([sys.executable, "-m", "bench.gpu_model", str(out), "--size", "0.5b"],
                   cwd=REPO, check=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def plain(model_05b, tmp_path_factory):
    """One plain GPU process, fp32 (a loose reference for the bf16 ZeRO runs)."""
    import torch

    out = tmp_path_factory.mktemp("plain")
    launch(None, 1, "plain", out, model_05b, cpu=False)
    return torch.load(out / "plain.pt")


@pytest.mark.parametrize("config,stage", ZERO_CONFIGS)
def test_zero_two_gpus_snapshot_checkpoint_resume(config, stage, plain, model_05b, tmp_path,
                                                  monkeypatch):
    import torch

    monkeypatch.setenv("PIPELINE_TEST_DTYPE", "bfloat16")  # as the yaml: bf16 weights
    launch(config, 2, "fresh", tmp_path, model_05b, cpu=False)
    fresh = torch.load(tmp_path / "fresh.pt")
    assert (fresh["world"], fresh["zero_stage"]) == (2, stage)
    check_full_snapshot(fresh, model_05b)
    assert all(t.dtype == torch.bfloat16 for t in fresh["snap"].values())

    # bf16 ZeRO on 2 GPUs against fp32 on one: the same loss scale (a 1/world slip is 2x). The
    # batch's behaviour logprobs are the model's own (importance weights ~1): a full-size
    # gradient, whose norm bf16 does not change by more than a few percent.
    a, b = fresh["metrics"][0], plain["metrics"][0]
    assert a["skipped_nonfinite"] == 0
    assert b["loss/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert a["loss/is_weight_mean"] == pytest.approx(1.0, abs=0.25)
    assert a["loss/loss"] == pytest.approx(b["loss/loss"], rel=0.25, abs=1e-3)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=0.25)

    ckpt = tmp_path / "run" / "checkpoints" / "step_2" / "deepspeed" / "zero"
    names = sorted(p.name for p in ckpt.iterdir())
    for r in (0, 1):
        assert optim_states(r, bf16=True) in names, names

    launch(config, 2, "resume", tmp_path, model_05b, cpu=False)
    # Same kernels, same batch: near bit-exact (CUDA's embedding backward is not: fp32 noise,
    # and a bf16 weight may round the other way); a rank with fresh Adam moments (step count
    # 1, not 3) is far off.
    check_resume_equals_uninterrupted(tmp_path, ranks=2, rtol=1e-3, atol=1e-6,
                                      snap_tol=(1e-2, 1e-3))


@pytest.mark.parametrize("config,route", [
    ("zero3.yaml", "file"), ("zero3.yaml", "auto"),  # auto: CUDA IPC (rank 0 on GPU 0)
    ("ddp.yaml", "auto")])  # plain data parallel: each rank holds the whole model
def test_pipeline_train_two_gpu_learner_then_resume(config, route, model_05b, tmp_path):
    run_dir = tmp_path / "run"
    tag = f"gpuds{os.getpid()}"

    def train(*extra: str) -> None:
        cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(model_05b),
               "--data", "arithmetic:200", "--reward", "pipeline.tasks.rewards:length_reward",
               "--num-producers", "1", "--batch-groups", "4", "--group-size", "4",
               "--max-tokens", "32", "--run-dir", str(run_dir), "--mode", "async",
               "--max-staleness", "1", "--engine.max_model_len", "512",
               "--engine.gpu_memory_utilization", "0.25", "--tensorboard", "false",
               "--train.learner_processes", "2", "--train.checkpoint_every", "2",
               "--sync.route", route,
               "--train.accelerate_config",
               str(REPO / "examples" / "accelerate" / config), *extra]
        env = dict(os.environ, PIPELINE_TEST_RUN=tag)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                              env=env)
        (run_dir / f"train{len(extra)}.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert_no_process_left(tag)

    train("--steps", "4")
    ckpt = run_dir / "checkpoints" / "step_4"
    if config.startswith("zero3"):
        shards = {p.name for p in (ckpt / "deepspeed" / "zero").iterdir()}
        for r in (0, 1):  # ZeRO-3: each rank's parameter and optimiser partitions
            assert optim_states(r, bf16=True) in shards, shards
            assert f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" in shards, shards
    version = json.loads((ckpt / "state.json").read_text())["version"]
    assert version >= 2

    train("--steps", "6", "--resume")
    rows = read_metrics(run_dir)
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["version"] >= version  # the resumed learner continued, not from 0
    assert all(r["learner_processes"] == 2 and r["skipped_nonfinite"] == 0 for r in rows)
    assert all(r["staleness_max"] <= 1 for r in rows)
