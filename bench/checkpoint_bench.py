"""Checkpoint cost on the training path and the write's speed, against one torch.save stream.

    python -m bench.checkpoint_bench --model tiny|smollm2-135m|0.5b|1.5b|3b|PATH [--saves 3]
        [--device cuda] [--dir /dev/shm/ckpt-bench]

Builds the trainer's state as the learner checkpoints it (fp32 model state dict, AdamW state
after one step, scheduler, RNG) and checks first that ``--dir`` has room for one checkpoint
(one line and exit 2 otherwise). Then, as the learner does: ``prepare`` allocates the staging
buffers (pinned on a GPU) before the first step, and ``CheckpointWriter.save`` runs ``--saves``
times with a training step's change to every tensor in between, behind the writer's fence:
``stall`` is what the loop waits for (starting the copy to host), ``write`` the background write
(copy wait, the safetensors files written by ``WRITE_THREADS`` threads, fsync, rename). At most
one checkpoint of the bench is on disk at a time (the previous one is removed before the next
save); the last is read back and compared with the state it was taken from (states up to
``VERIFY_BYTES``), then removed. The baseline
writes the same state with one ``torch.save`` stream and fsync, the layout checkpoints had
before. A size of bench.gpu_model (0.5b, 1.5b, 3b, 7b) is written once under ``--models-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.learner.checkpoint import (
    WRITE_THREADS,
    CheckpointWriter,
    LearnerState,
    host_copy,
    load_checkpoint,
    tensor_bytes,
)
from pipeline.learner.disk import disk_free
from pipeline.models import resolve_model

VERIFY_BYTES = 4e9  # larger states are not read back: two more copies in host memory


def trainer_state(model_dir: Path, device: str) -> tuple[dict, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.startswith("cuda") or None)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # exp_avg and exp_avg_sq exist, as after the first training step
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}, opt


def model_dir(spec: str, cache: Path, models_dir: Path) -> Path:
    from bench.gpu_bench import prepare_model
    from bench.gpu_model import SIZES

    return Path(prepare_model(spec, models_dir)) if spec in SIZES else \
        resolve_model(spec, cache)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def torch_save_gbps(state: dict, where: Path, nbytes: int) -> float:
    """One torch.save stream of the live state and its fsync, as checkpoints were written."""
    where.mkdir(parents=True)
    t0 = time.monotonic()
    with open(where / "trainer.pt", "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    s = time.monotonic() - t0
    shutil.rmtree(where)
    return nbytes / 1e9 / s


async def run(args: argparse.Namespace, state: dict, opt: torch.optim.Optimizer, root: Path,
              nbytes: int) -> dict:
    w = CheckpointWriter(root / "async", keep=1)
    t0 = time.monotonic()
    plan, count, cuda = tensor_bytes(state)
    w.prepare(plan, count, pin=cuda)
    prepare_s = time.monotonic() - t0
    stalls, writes = [], []
    expected = None
    for step in range(1, args.saves + 1):
        if w.written is not None:  # at most one copy of the bench on disk
            shutil.rmtree(w.written)
        if step == args.saves and nbytes <= VERIFY_BYTES:
            expected = host_copy(state)  # what the last checkpoint must hold
        stall = await w.save(LearnerState(step=step), lambda: state, b"", lambda p: None)
        stalls.append(stall)
        w.fence()  # the next optimiser step changes every tensor, after the copy
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    p.add_(1e-3)
                    for t in opt.state[p].values():
                        t.add_(1.0)
        await w.wait()
        error = w.take_error()
        if error is not None:
            raise SystemExit(f"checkpoint_bench: {error}")
        writes.append(w.write_s or 0.0)
    exact = "n/a" if expected is None else _same(expected, load_checkpoint(w.written)[1])
    del expected
    shutil.rmtree(w.written)
    torch_gbps = torch_save_gbps(state, root / "torch", nbytes)
    return {"prepare_s": prepare_s, "stalls": stalls, "writes": writes, "exact": exact,
            "torch_gbps": torch_gbps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pipeline-models"))
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/bench-models"))
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the checkpoints are written (a fresh folder inside it)")
    args = ap.parse_args(argv)
    state, opt = trainer_state(model_dir(args.model, Path(args.cache), args.models_dir),
                               args.device)
    nbytes = tensor_bytes(state)[0]
    args.dir.mkdir(parents=True, exist_ok=True)
    free = disk_free(args.dir)
    if free < nbytes * 1.05:
        print(f"checkpoint_bench: a checkpoint of {nbytes} bytes does not fit in {args.dir} "
              f"({free} bytes free); choose another --dir", file=sys.stderr)
        raise SystemExit(2)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        r = asyncio.run(run(args, state, opt, root, nbytes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_s = statistics.median(r["writes"])
    print(f"| model | state GB | device | dir | prepare s | stall s (first) | stall s (later) "
          f"| write s | write GB/s ({WRITE_THREADS} threads) | torch.save GB/s | exact |\n"
          f"|---|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.model} | {nbytes / 1e9:.2f} | {args.device} | {args.dir} "
          f"| {r['prepare_s']:.2f} | {r['stalls'][0]:.3f} "
          f"| {statistics.median(r['stalls'][1:] or r['stalls']):.3f} | {write_s:.2f} "
          f"| {nbytes / 1e9 / write_s:.2f} | {r['torch_gbps']:.2f} | {r['exact']} |")


if __name__ == "__main__":
    main()
