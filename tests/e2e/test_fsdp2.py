"""The FSDP2 learner (``train.fsdp2``) on 2 CPU processes (gloo), launched as pipeline-train
launches a multi-process learner without an accelerate config (torchrun), in one launch:

- in fp32 its first step equals a 2-rank DDP learner's (loss to 1e-4, gradient norm to 1e-3,
  as the ZeRO tests hold DeepSpeed to): the sharded path scales the loss, pads the micro-batches
  and clips like the unsharded one;
- in bf16 (bf16 compute over fp32 master shards, fp32 gradient reduction) its first step's loss
  is the fp32 step's to 0.5% and its gradient norm to 1%: bf16's 8-bit mantissa rounds each
  op by up to 0.4%, and a wrong reduction or loss scaling is off by a factor of 2 at least;
- its snapshots are the full model, bucket by bucket equal to the whole gather;
- a checkpoint holds every rank's shards, and step 3 of a trainer resumed from it equals the
  uninterrupted step 3 exactly (loss, weights, every rank's AdamW state); ``pipeline-train
  eval``'s reader consolidates those shards into the weights of that step.

This file is also the per-rank script: ``accelerate launch --multi_gpu ... THIS_FILE OUT MODEL``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.ports import free_port

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (REPO, HERE):  # run as a script by accelerate launch
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

STEPS = 3  # a checkpoint after step 2; step 3 runs uninterrupted and after a resume


def _config(model_dir: str, out: Path, dtype: str, fsdp2: bool = True):
    from pipeline.config import load_config

    return load_config(overrides={
        "model.path": model_dir, "data.path": "arithmetic:10", "model.dtype": dtype,
        "train.micro_batch": 2, "generation.group_size": 4, "train.lr": 1e-3,
        "train.loss.kl_coef": 0.05, "train.warmup_steps": 3, "run_dir": str(out / "run"),
        "train.learner_processes": 2, "train.fsdp2": fsdp2})


def _optimizer_state(tr) -> dict:
    """This rank's AdamW state: its shards of the moments (and the step counts)."""
    out: dict = {}
    for i, p in enumerate(pp for g in tr.optimizer.param_groups for pp in g["params"]):
        for k, v in tr.optimizer.state.get(p, {}).items():
            v = v.to_local() if hasattr(v, "to_local") else v
            out[f"{i}.{k}"] = v.detach().clone() if hasattr(v, "detach") else v
    return out


def _lead(tr, work) -> object:
    """Rank 0 runs ``work(tr)`` and lets the others go; the others follow until then."""
    from pipeline.learner import distributed as D

    if not D.is_main():
        tr.follow()
        return None
    try:
        return work(tr)
    finally:
        tr.release_followers()


def _run(out: Path, model_dir: str) -> None:
    """Per rank: a DDP fp32 and an FSDP2 fp32 trainer's first step; the FSDP2 bf16 trainer's 3
    steps (checkpoint after 2) with snapshots; a fresh FSDP2 bf16 trainer resumed from that
    checkpoint, step 3. Rank 0 saves metrics and snapshots, every rank its AdamW states."""
    import torch
    from test_deepspeed import batch, own_logprobs

    from pipeline.learner import distributed as D
    from pipeline.learner.checkpoint import (
        LearnerState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from pipeline.learner.trainer import PolicyTrainer

    batches: dict[int, list] = {}
    if D.is_main():
        batches = {step: batch(step) for step in range(1, STEPS + 1)}
        own_logprobs(list(batches.values()), model_dir)
    first = {}
    for name, dtype, fsdp2 in (("ddp", "float32", False), ("fp32", "float32", True)):
        tr = PolicyTrainer(_config(model_dir, out, dtype, fsdp2), model_dir)
        first[name] = _lead(tr, lambda tr: tr.step(batches[1], 0))
        del tr

    def fresh(tr) -> dict:
        res = {"world": tr.world, "sharded": tr.sharded, "snap0": tr.snapshot_tensors(),
               "metrics": [], **first}
        for step in range(1, STEPS + 1):
            res["metrics"].append(tr.step(batches[step], step - 1))
            if step == 2:
                save_checkpoint(out / "run", LearnerState(step=2, version=2), tr.state(), b"",
                                shards=tr.save_shards)
                res["snap2"] = tr.snapshot_tensors()
        res["snap"] = tr.snapshot_tensors()
        res["buckets"] = [{k: v.clone() for k, v in b.items()}
                          for b in tr.snapshot_buckets(64 << 10)]
        return res

    def resume(tr) -> dict:
        path = latest_checkpoint(out / "run")
        st, tensors, _buf = load_checkpoint(path)
        tr.load_state(tensors, path)
        return {"metrics": [tr.step(batches[st.step + 1], st.step)],
                "snap": tr.snapshot_tensors()}

    for phase, work in (("fresh", fresh), ("resume", resume)):
        tr = PolicyTrainer(_config(model_dir, out, "bfloat16"), model_dir)
        res = _lead(tr, work)
        if D.is_main():
            torch.save(res, out / f"{phase}.pt")
        torch.save(_optimizer_state(tr), out / f"{phase}_optim_rank{tr.rank}.pt")
        del tr


def launch(out: Path, model: Path) -> None:
    """``_run`` on 2 ranks, launched as pipeline-train launches a multi-process learner
    without an accelerate config."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
           "--num_machines", "1", "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend",
           "no", "--main_process_port", str(free_port()), __file__, str(out), str(model)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    (out / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"failed (log: {out}/run.log):\n{proc.stderr[-6000:]}"


def test_fsdp2_steps_match_fp32_and_resume_exactly(tiny_model, tmp_path):
    import torch
    from test_deepspeed import check_full_snapshot, check_resume_equals_uninterrupted

    launch(tmp_path, tiny_model)
    fresh = torch.load(tmp_path / "fresh.pt")
    assert (fresh["world"], fresh["sharded"]) == (2, True)
    check_full_snapshot(fresh, tiny_model)

    # fp32 FSDP2 == fp32 DDP over the same 2 ranks (same weights, batch, loss scaling, clip),
    # on a full-size gradient (behaviour logprobs are the model's: importance weights ~1).
    ddp, fp32 = fresh["ddp"], fresh["fp32"]
    assert ddp["loss/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert fp32["loss/loss"] == pytest.approx(ddp["loss/loss"], rel=1e-4, abs=1e-6)
    assert fp32["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-3)

    # bf16 compute: the first step's loss and gradient norm within bf16 rounding of fp32's.
    bf16 = fresh["metrics"][0]
    assert bf16["skipped_nonfinite"] == 0
    assert bf16["loss/loss"] == pytest.approx(fp32["loss/loss"], rel=5e-3)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-2)

    # Bucket by bucket (64 KiB, far below the model) equals the whole gather.
    buckets = fresh["buckets"]
    assert len(buckets) > 3
    joined = {k: v for b in buckets for k, v in b.items()}
    assert list(joined) == list(fresh["snap"])
    for k, v in fresh["snap"].items():
        assert torch.equal(joined[k].to(v.dtype), v), k

    ckpt = tmp_path / "run" / "checkpoints" / "step_2" / "fsdp"
    assert (ckpt / ".metadata").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    check_resume_equals_uninterrupted(tmp_path, ranks=2, rtol=0, atol=0)

    # One process reads the shards back as the model of step 2 (fp32 masters, cast as a
    # snapshot casts them).
    from pipeline.launch.checkpoint_weights import checkpoint_weights

    state, weights, what = checkpoint_weights(tmp_path / "run" / "checkpoints" / "step_2",
                                              str(tiny_model), 16.0, torch.bfloat16)
    assert state.step == 2 and what == "FSDP2 over 2 ranks (consolidated)"
    assert set(weights) == set(fresh["snap2"])
    for k, v in fresh["snap2"].items():
        assert torch.equal(weights[k], v), k


if __name__ == "__main__":
    from tests.e2e.support.ranks import end_rank

    _run(Path(sys.argv[1]), sys.argv[2])
    end_rank()
