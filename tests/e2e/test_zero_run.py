"""A 2-rank DeepSpeed ZeRO-3 learner (CPU, gloo) through the real launcher with one vLLM CPU
producer on the tiny model, in one run that is then evaluated and resumed:

1. sync mode, 3 steps, 0.25 MB weight buckets: every version is gathered bucket by bucket (the
   follower rank in step through the "buckets" command), written, announced and loaded;
2. the step-2 checkpoint holds both ranks' optimiser partitions, and ``pipeline-train eval`` of
   it gives the same ``eval/reward_mean`` as the in-training evaluation of version 2 at
   temperature 0 (the reward is the completion text's crc32, so equal means the same texts);
3. ``--resume`` with a larger ``--steps`` continues from the final checkpoint on 2 ranks.

ZeRO-2 under the launcher differs from ZeRO-3 only in what the trainer gathers, which
test_deepspeed.py checks for both stages.

The trainer-level ZeRO-2/3 checks (a 2-rank step equals one process, a resumed step equals an
uninterrupted one on every rank's optimiser state) are in test_deepspeed.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from tests.e2e.support.launcher import read_metrics
from tests.e2e.support.train_run import REPO, pipeline_train, tiny_args

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install deepspeed; DS_BUILD_OPS=0 is enough)")]

CPU_RANKS = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def test_zero3_learner_buckets_checkpoint_eval_and_resume(tiny_model, tmp_path):
    conf = yaml.safe_load((REPO / "examples" / "accelerate" / "zero3.yaml").read_text())
    conf["mixed_precision"] = "no"  # CPU
    (tmp_path / "zero3_cpu.yaml").write_text(yaml.safe_dump(conf))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(
        json.dumps({"prompt": f"{a}+{a+1}=", "answer": str(2 * a + 1), "prompt_id": f"h{a}"})
        + "\n" for a in range(4)))
    run_dir = tmp_path / "run"
    common = (*tiny_args(tiny_model, run_dir, data="arithmetic:64", group_size=2),
              "--reward", "tests.e2e.support.text_rewards:fingerprint", "--mode", "sync",
              "--train.lr", "0.01", "--tensorboard", "false",
              "--train.learner_processes", "2", "--sync.bucket_mb", "0.25",
              "--train.accelerate_config", str(tmp_path / "zero3_cpu.yaml"))
    pipeline_train(*common, "--steps", "3", "--train.checkpoint_every", "2",
                   "--eval.data", str(heldout), "--eval.every", "2", "--eval.temperature", "0",
                   "--eval.samples_per_prompt", "1", "--eval.max_prompts", "4",
                   tag="zero3run", env=CPU_RANKS)
    rows = _rows(run_dir)
    train = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["version"] for r in train] == [1, 2, 2]  # sync mode: each batch on the newest
    assert all(r.get("sync_failures", 0) == 0 and r["skipped_nonfinite"] == 0 for r in train)
    assert all(r["learner_processes"] == 2 for r in train)
    assert all(r["snapshot_buckets"] > 2 for r in train[:2])  # 0.8 MB of weights, 0.25 MB each

    # The step-2 checkpoint: both ranks' partitions, and the evaluation of version 2 again.
    ckpt = run_dir / "checkpoints" / "step_2"
    shards = {p.name for p in (ckpt / "deepspeed" / "zero").iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= shards, shards
    evals = {int(r["eval/version"]): r for r in rows if "eval/version" in r}
    assert sorted(evals) == [0, 2], sorted(evals)
    out = tmp_path / "step2_eval.json"
    proc = pipeline_train("eval", "--checkpoint", str(ckpt), "--out", str(out),
                          tag="zero3run", env=CPU_RANKS)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "DeepSpeed ZeRO-3 (consolidated)" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert result["step"] == 2 and result["version"] == 2
    assert result["eval/prompts"] == evals[2]["eval/prompts"] == 4.0
    assert result["eval/reward_mean"] == pytest.approx(evals[2]["eval/reward_mean"], abs=1e-9)
    # ...and version 2 is not the base model: the checkpoint's trained weights were loaded.
    assert evals[2]["eval/reward_mean"] != pytest.approx(evals[0]["eval/reward_mean"], abs=1e-9)

    # --resume: the final checkpoint (step 3, version 2) on 2 ranks again, two more steps.
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == "step_3"
    pipeline_train(*common, "--steps", "5", "--resume", tag="zero3run", env=CPU_RANKS)
    resumed = [r for r in _rows(run_dir) if "reward_mean" in r][3:]
    assert [r["step"] for r in resumed] == [4, 5]
    assert [r["version"] for r in resumed] == [3, 3]  # continues from v2, publishes v3
    assert all(r["learner_processes"] == 2 and r["skipped_nonfinite"] == 0 for r in resumed)
    state = json.loads((run_dir / "checkpoints" / "step_5" / "state.json").read_text())
    assert state["step"] == 5 and state["version"] == 3
