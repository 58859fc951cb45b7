"""The learner under DeepSpeed ZeRO-2/3 on 2 CPU processes (DS_ACCELERATOR=cpu, gloo), with the
shipped accelerate configs (examples/accelerate/, bf16 turned off on CPU): a 2-rank ZeRO step
trains like a single plain process, the snapshot is the full model (ZeRO-3 partitions gathered),
and a checkpoint restores every rank's optimiser partition (a resumed step equals an
uninterrupted one, on every rank's optimiser state and on the weights).

This file is also the per-rank script: ``accelerate launch ... THIS_FILE PHASE OUT_DIR MODEL``.
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
if str(REPO) not in sys.path:  # run as a script by accelerate launch
    sys.path.insert(0, str(REPO))

STEPS = 3  # a checkpoint after step 2; step 3 runs uninterrupted (fresh) and after a resume


def batch(i: int) -> list:
    """Fixed batch i: 3 groups of 4 completions of uneven lengths (uneven rank slices), with
    made-up behaviour logprobs (``own_logprobs`` replaces them)."""
    import numpy as np

    from buffer.schema import Completion, RolloutGroup

    rng = np.random.default_rng(i)
    groups = []
    for g in range(3):
        plen = int(rng.integers(3, 9))
        comps = [Completion(token_ids=rng.integers(32, 127, size=int(t)).astype(np.int32),
                            logprobs=(-rng.random(int(t)) - 0.1).astype(np.float32),
                            version_segments=[(0, 0)], reward=float(rng.random()))
                 for t in rng.integers(1, 9, size=4)]
        groups.append(RolloutGroup(group_id=f"{i}-{g}", producer_id="p0", prompt_id=f"{i}-{g}",
                                   prompt_token_ids=rng.integers(32, 127, size=plen)
                                   .astype(np.int32), completions=comps))
    return groups


def own_logprobs(batches: list[list], model_dir: str) -> None:
    """Set the behaviour logprobs of ``batches`` to the model's own (fp32, CPU), in place.

    Importance weights are then ~1 and a step's gradient is the full GRPO one. Made-up logprobs
    (-0.1..-1.1) are far from a random model's (about -ln(vocab): -12 for Qwen2's), which gives
    weights ~1e-5 and a gradient so small that precision noise decides its norm (bf16 policy
    weights against the fp32 KL reference: 46x the fp32 norm on the GPU test's 0.5B model)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for g in (g for groups in batches for g in groups):
            p = len(g.prompt_token_ids)
            for c in g.completions:
                ids = torch.from_numpy(np.concatenate([g.prompt_token_ids, c.token_ids])
                                       .astype(np.int64))[None]
                # Token p + k is predicted by the logits at p + k - 1.
                logp = torch.log_softmax(model(ids).logits[0, p - 1:-1].float(), dim=-1)
                c.logprobs = logp.gather(-1, ids[0, p:, None])[:, 0].numpy()


def optimizer_state(tr) -> dict:
    """This rank's optimiser state: under ZeRO, the base optimiser's partitions."""
    opt = tr.optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO optimiser (or torch)
    base = getattr(opt, "optimizer", opt)
    params = [pp for g in base.param_groups for pp in g["params"]]
    # ZeRO-3 hands its fp32 partitions to the base optimiser only inside step().
    params = params or list(getattr(opt, "fp32_partitioned_groups_flat", []))
    out: dict = {}
    for i, p in enumerate(params):
        for k, v in base.state.get(p, {}).items():
            out[f"{i}.{k}"] = v.detach().clone().cpu() if hasattr(v, "detach") else v
    return out


def _run(phase: str, out: Path, model_dir: str) -> None:
    """Per rank. fresh: 3 steps (checkpoint after 2); resume: load it, step 3; plain: 3 steps,
    one process, no DeepSpeed. Rank 0 saves metrics and snapshots; every rank its optimiser."""
    import torch

    from pipeline.config import load_config
    from pipeline.learner import distributed as D
    from pipeline.learner.checkpoint import (
        LearnerState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from pipeline.learner.trainer import PolicyTrainer

    dtype = os.environ.get("PIPELINE_TEST_DTYPE", "float32")  # bfloat16 on GPUs (the yaml's bf16)
    batches: dict[int, list] = {}
    if D.is_main():  # before the trainer: after it, ZeRO-3 makes from_pretrained a collective
        batches = {step: batch(step) for step in range(1, STEPS + 1)}
        own_logprobs(list(batches.values()), model_dir)
    cfg = load_config(overrides={
        "model.path": model_dir, "data.path": "arithmetic:10", "model.dtype": dtype,
        "train.micro_batch": 2, "generation.group_size": 4, "train.lr": 1e-3,
        "train.loss.kl_coef": 0.05, "train.warmup_steps": 3, "run_dir": str(out / "run")})
    tr = PolicyTrainer(cfg, model_dir)  # CUDA where there is one
    if D.is_main():
        res: dict = {"world": tr.world, "zero_stage": tr.zero_stage,
                     "snap0": tr.snapshot_tensors(), "metrics": []}
        first = 1
        if phase == "resume":
            path = latest_checkpoint(out / "run")
            st, tensors, _buf = load_checkpoint(path)
            tr.load_state(tensors, path)
            first = st.step + 1
        for step in range(first, STEPS + 1):
            res["metrics"].append(tr.step(batches[step], step - 1))
            if phase == "fresh" and step == 2:
                save_checkpoint(out / "run", LearnerState(step=2, version=2), tr.state(), b"",
                                shards=tr.save_shards)
        res["snap"] = tr.snapshot_tensors()
        torch.save(res, out / f"{phase}.pt")
        tr.release_followers()
    else:
        tr.follow()
    torch.save(optimizer_state(tr), out / f"{phase}_optim_rank{tr.rank}.pt")


def launch(config: str | None, n: int, phase: str, out: Path, model: Path, cpu: bool = True,
           bf16_on_cpu: bool = False) -> None:
    """``phase`` of ``_run`` on ``n`` ranks with examples/accelerate/``config`` (None: one plain
    process); on CPU with DeepSpeed's CPU accelerator and bf16 off (unless ``bf16_on_cpu``), on
    GPUs as the yaml says."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    if config is None:
        cmd = [sys.executable, __file__, phase, str(out), str(model)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "examples" / "accelerate" / config), "--num_processes", str(n),
               "--num_machines", "1", "--main_process_port", str(free_port()),
               *(["--mixed_precision", "no"] if cpu and not bf16_on_cpu else []),
               __file__, phase, str(out), str(model)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    (out / f"{phase}.log").write_text(proc.stdout + proc.stderr)
    noise = ("Warning", "return func(")
    err = "\n".join(x for x in proc.stderr.splitlines() if not any(w in x for w in noise))
    assert proc.returncode == 0, f"{phase} failed (log: {out / phase}.log):\n{err[-6000:]}"


@pytest.fixture(scope="module")
def plain(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    launch(None, 1, "plain", out, tiny_model)
    import torch

    return torch.load(out / "plain.pt")


ZERO_CONFIGS = [("zero2.yaml", 2), ("zero3.yaml", 3), ("zero3_offload.yaml", 3)]


@pytest.mark.parametrize("config,stage", ZERO_CONFIGS)
def test_zero_two_ranks_checkpoint_restores_every_rank(config, stage, plain, tiny_model,
                                                       tmp_path):
    import torch

    launch(config, 2, "fresh", tmp_path, tiny_model)
    fresh = torch.load(tmp_path / "fresh.pt")
    assert (fresh["world"], fresh["zero_stage"]) == (2, stage)
    check_full_snapshot(fresh, tiny_model)

    # 2 ZeRO ranks train like one plain process (loss scaling, uneven slices, KL reference),
    # on a full-size gradient (behaviour logprobs are the model's: importance weights ~1).
    assert plain["metrics"][0]["loss/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    for a, b in zip(fresh["metrics"], plain["metrics"], strict=True):
        assert a["skipped_nonfinite"] == 0
        assert a["loss/loss"] == pytest.approx(b["loss/loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    for name, t in plain["snap"].items():
        torch.testing.assert_close(fresh["snap"][name], t, rtol=1e-4, atol=1e-5, msg=name)

    # The checkpoint holds both ranks' optimiser partitions...
    ckpt = tmp_path / "run" / "checkpoints" / "step_2" / "deepspeed" / "zero"
    names = sorted(p.name for p in ckpt.iterdir())
    for r in (0, 1):
        assert optim_states(r) in names, names

    # ...and a resume restores them: step 3 after the resume equals the uninterrupted step 3 on
    # every rank's optimiser state (a rank starting from empty Adam moments would differ).
    launch(config, 2, "resume", tmp_path, tiny_model)
    check_resume_equals_uninterrupted(tmp_path, ranks=2, rtol=1e-5, atol=1e-7)


def test_zero3_bf16_checkpoint_resume_on_cpu(tiny_model, tmp_path, monkeypatch):
    """The yaml's bf16, as on GPUs: DeepSpeed then names the optimiser partitions bf16_*, and a
    resume must still restore them (checked on 2 H200s only up to the checkpoint, so here)."""
    monkeypatch.setenv("PIPELINE_TEST_DTYPE", "bfloat16")
    launch("zero3.yaml", 2, "fresh", tmp_path, tiny_model, bf16_on_cpu=True)
    ckpt = tmp_path / "run" / "checkpoints" / "step_2" / "deepspeed" / "zero"
    names = sorted(p.name for p in ckpt.iterdir())
    for r in (0, 1):
        assert optim_states(r, bf16=True) in names, names
    launch("zero3.yaml", 2, "resume", tmp_path, tiny_model, bf16_on_cpu=True)
    check_resume_equals_uninterrupted(tmp_path, ranks=2, rtol=1e-3, atol=1e-6,
                                      snap_tol=(1e-2, 1e-3))


def optim_states(rank: int, bf16: bool = False) -> str:
    """A rank's optimiser partition file in a DeepSpeed checkpoint; DeepSpeed prefixes it with
    bf16_ under bf16 (the shipped configs on GPUs; the CPU tests run without bf16 unless asked)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def hf_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def check_full_snapshot(res: dict, model_dir: Path) -> None:
    """The snapshot is the full model: every trainable tensor under its HF name, with the HF
    shape, and (before any step) the HF values as the engines' dtype holds them."""
    import torch

    hf = hf_weights(model_dir)
    snap0 = res["snap0"]
    assert snap0 and set(snap0) <= set(hf), sorted(set(snap0) - set(hf))
    missing = {k for k in hf if k not in snap0 and k != "lm_head.weight"}
    assert not missing, sorted(missing)  # nothing frozen here: every tensor travels
    for name, t in snap0.items():
        assert t.shape == hf[name].shape, name
        torch.testing.assert_close(t, hf[name].to(t.dtype), msg=name)
    assert {k: v.shape for k, v in res["snap"].items()} == {k: v.shape for k, v in snap0.items()}


def check_resume_equals_uninterrupted(out: Path, ranks: int, rtol: float, atol: float,
                                      snap_tol: tuple[float, float] | None = None) -> None:
    """Step 3 after the resume equals the uninterrupted step 3: loss, weights (``snap_tol``:
    rtol, atol; bf16 snapshots may differ by one rounding) and each rank's optimiser state."""
    import torch

    s_rtol, s_atol = snap_tol or (rtol, atol)
    fresh, resumed = torch.load(out / "fresh.pt"), torch.load(out / "resume.pt")
    assert resumed["metrics"][0]["loss/loss"] == pytest.approx(
        fresh["metrics"][-1]["loss/loss"], rel=max(rtol, 1e-6))
    for name, t in fresh["snap"].items():
        torch.testing.assert_close(resumed["snap"][name], t, rtol=s_rtol, atol=s_atol,
                                   msg=name)
    for r in range(ranks):
        a = torch.load(out / f"fresh_optim_rank{r}.pt")
        b = torch.load(out / f"resume_optim_rank{r}.pt")
        assert a and set(a) == set(b), r
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(b[k], v, rtol=rtol, atol=atol, msg=f"rank {r} {k}")
            else:
                assert b[k] == v, (r, k)


if __name__ == "__main__":
    from tests.e2e.support.ranks import end_rank

    _run(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    end_rank()
