"""Checkpoint cost on the training path: the synchronous save against the background writer.

    python -m bench.checkpoint_bench --model tiny|smollm2-135m|PATH [--saves 3] [--device cuda]

Builds the trainer's state as the learner checkpoints it (model state dict, AdamW state after one
step, scheduler, RNG), then times (1) ``save_checkpoint`` on the live state, which is what the
training loop waited for before, and (2) ``CheckpointWriter.save`` several times with the state
changed in between: ``stall`` is what the loop waits for now (the host copy; the first one also
allocates the staging buffers), ``write`` the background write that overlaps training.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipeline.learner.checkpoint import CheckpointWriter, LearnerState, save_checkpoint
from pipeline.models import resolve_model


def trainer_state(model_dir: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # exp_avg and exp_avg_sq exist, as after the first training step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "_params": opt}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pipeline-models"))
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    state = trainer_state(resolve_model(args.model, Path(args.cache)), args.device)
    opt = state.pop("_params")
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values()) + sum(
        t.numel() * t.element_size() for s in state["optimizer"]["state"].values()
        for t in s.values() if isinstance(t, torch.Tensor))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        save_checkpoint(Path(tmp) / "sync", LearnerState(step=1), state, b"")
        sync_s = time.monotonic() - t0

        async def background() -> tuple[list[float], list[float]]:
            w = CheckpointWriter(Path(tmp) / "async")
            stalls, writes = [], []
            for step in range(1, args.saves + 1):
                stalls.append(await w.save(LearnerState(step=step), lambda: state, b"",
                                           lambda p: None))
                with torch.no_grad():  # the next training step changes every tensor in place
                    for group in opt.param_groups:
                        for p in group["params"]:
                            p.add_(1e-3)
                await w.wait()
                writes.append(w.write_s or 0.0)
            return stalls, writes

        stalls, writes = asyncio.run(background())
    print(f"| model | state GB | device | sync save s | stall s (first) | stall s (later) "
          f"| background write s |\n|---|---|---|---|---|---|---|\n"
          f"| {args.model} | {nbytes / 1e9:.2f} | {args.device} | {sync_s:.2f} | {stalls[0]:.3f} "
          f"| {statistics.median(stalls[1:] or stalls):.3f} | {statistics.median(writes):.2f} |")


if __name__ == "__main__":
    main()
