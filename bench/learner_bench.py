"""Learner-only throughput: PolicyTrainer optimiser steps on synthetic GRPO batches, no engine.

    python -m bench.learner_bench --size 3b --variants legacy,rows,packed --out runs/learner

Each variant is one set of ``train.*`` options (VARIANTS) run in a fresh process (its own CUDA
memory; an out-of-memory variant is reported, not fatal) on the same batch: BATCH prompts x G
completions of PROMPT + completion tokens (``--lengths fixed``: every completion MAX tokens, as
the throughput benchmarks' ignore_eos; ``variable``: uniform in [MAX/8, MAX], as real GRPO).
Timed: ``--steps`` optimiser steps after one warm-up; reported per variant: seconds per step,
learner tokens/s (prompt and completion tokens through the forward), model TFLOP/s and MFU
(pipeline.learner.flops, the same count for every variant) and peak GPU memory.

``legacy`` runs the same steps with another checkout's ``pipeline`` package (``--legacy-root``,
e.g. ``git archive <commit> pipeline buffer sync | tar -x -C .legacy``): before vs after in one
run, on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# train.* options per variant; every variant also gets BASE.
VARIANTS: dict[str, dict[str, Any]] = {
    "legacy": {"train.micro_batch": 16},
    "rows": {"train.micro_batch": 16, "train.logprob_chunk": 0},
    "rows-chunk": {"train.micro_batch": 16},
    "packed-5k": {"train.packing": True, "train.micro_batch_tokens": 5120},
    "packed-8k": {"train.packing": True, "train.micro_batch_tokens": 8192},
    "packed-16k": {"train.packing": True, "train.micro_batch_tokens": 16384},
    "packed-32k-ckpt": {"train.packing": True, "train.micro_batch_tokens": 32768,
                        "train.gradient_checkpointing": True},
}
BASE = {"data.path": "arithmetic:10", "train.lr": 1e-6,
        "rewards.specs": [{"fn": "pipeline.tasks.rewards:exact_match"}]}


def synthetic_groups(n_groups: int, group_size: int, prompt: int, max_tokens: int,
                     lengths: str, vocab: int, seed: int = 0) -> list:
    import numpy as np

    from buffer.schema import Completion, RolloutGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        comps = []
        for _ in range(group_size):
            t = max_tokens if lengths == "fixed" else int(rng.integers(max_tokens // 8,
                                                                       max_tokens + 1))
            comps.append(Completion(
                token_ids=rng.integers(0, vocab, size=t).astype(np.int32),
                logprobs=(-rng.random(t) * 3).astype(np.float32),
                version_segments=[(0, 0)], reward=float(rng.integers(0, 2)),
                reward_breakdown={}))
        groups.append(RolloutGroup(group_id=f"g{g}", producer_id="p0", prompt_id=f"g{g}",
                                   prompt_token_ids=rng.integers(0, vocab, size=prompt)
                                   .astype(np.int32), completions=comps))
    return groups


def child(args: argparse.Namespace) -> None:
    """One variant: build the trainer, warm up, time ``args.steps`` steps; print one JSON line."""
    import torch

    from pipeline.config import load_config
    from pipeline.learner.trainer import PolicyTrainer

    over = {**BASE, "model.path": args.model, "run_dir": args.run_dir,
            "generation.group_size": args.group_size, **json.loads(args.options)}
    cfg = load_config(overrides=over)
    trainer = PolicyTrainer(cfg, args.model)
    groups = synthetic_groups(args.batch, args.group_size, args.prompt, args.max_tokens,
                              args.lengths, trainer.vocab_size)
    cuda = torch.cuda.is_available()
    trainer.step(groups, 0)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step(groups, 0)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if m["skipped_nonfinite"]:
            raise RuntimeError("a step was skipped as non-finite")
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    print("RESULT " + json.dumps({"step_s": times, "peak_gib": peak}), flush=True)


def measure(args: argparse.Namespace, name: str) -> dict[str, Any]:
    import numpy as np

    # The legacy variant runs from the other checkout's root (its pipeline package first on
    # the path), with this file copied into it as bench/learner_bench.py.
    cwd = Path(args.legacy_root).resolve() if name == "legacy" else Path.cwd()
    cmd = [sys.executable, "-m", "bench.learner_bench", "--child", "--model", args.model,
           "--run-dir", str(args.out / name), "--options", json.dumps(VARIANTS[name]),
           *[f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
             ("batch", "group-size", "prompt", "max-tokens", "lengths", "steps")]]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                           timeout=args.variant_timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"over {args.variant_timeout:.0f} s", "wall_s":
                time.monotonic() - t0}
    (args.out / f"{name}.log").write_text(p.stdout + p.stderr)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"variant": name, "error": "out of memory" if "out of memory" in p.stderr
                else tail[:160], "wall_s": time.monotonic() - t0}
    r = json.loads(lines[-1].removeprefix("RESULT "))
    r.update(variant=name, wall_s=time.monotonic() - t0, step_s_mean=float(np.mean(r["step_s"])))
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="3b", help="bench.gpu_model size, or a model directory")
    p.add_argument("--variants", default="legacy,rows,packed-16k")
    p.add_argument("--batch", type=int, default=16, help="prompts (groups) per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lengths", choices=["fixed", "variable"], default="fixed")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--legacy-root", default=".legacy")
    p.add_argument("--variant-timeout", type=float, default=240)
    p.add_argument("--out", type=Path, default=Path("runs/learner"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    import torch
    from transformers import AutoConfig

    from pipeline.learner.flops import ModelShape, peak_flops, train_flops

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if "legacy" in args.variants.split(","):
        legacy = Path(args.legacy_root) / "bench"
        legacy.mkdir(parents=True, exist_ok=True)
        (legacy / "learner_bench.py").write_text(Path(__file__).read_text())
        (legacy / "__init__.py").touch()
    if Path(args.size).is_dir():
        args.model = str(Path(args.size).resolve())
    else:
        args.model = f"/tmp/bench-models/{args.size}"
        if not (Path(args.model) / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "bench.gpu_model", args.model, "--size",
                            args.size], check=True)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(args.model))
    lengths = [args.prompt + len(c.token_ids) for g in synthetic_groups(
        args.batch, args.group_size, args.prompt, args.max_tokens, args.lengths,
        shape.vocab) for c in g.completions]
    loss_tokens = sum(lengths) - args.prompt * len(lengths)
    flops = train_flops(shape, lengths, loss_tokens)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = peak_flops(device)
    rows = []
    for name in args.variants.split(","):
        r = measure(args, name)
        if "step_s_mean" in r:
            s = r["step_s_mean"]
            r.update(tokens_per_s=sum(lengths) / s, tflops=flops / s / 1e12,
                     mfu=flops / s / peak if peak else None)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "step_s"}), flush=True)
    head = (f"Learner alone, {args.size} on {device}: {args.batch} prompts x {args.group_size}, "
            f"prompt {args.prompt} + completion {args.lengths} <= {args.max_tokens} tokens "
            f"({sum(lengths)} tokens a step), {args.steps} timed steps after 1 warm-up")
    table = [head, "", "| variant | train.* options | s/step | tokens/s | TFLOP/s | MFU | "
             "peak GiB |", "|---|---|---|---|---|---|---|"]
    base = next((r for r in rows if "step_s_mean" in r), None)
    for r in rows:
        opts = ", ".join(f"{k.removeprefix('train.')}={v}" for k, v in
                         VARIANTS[r["variant"]].items())
        if "error" in r:
            table.append(f"| {r['variant']} | {opts} | {r['error']} | | | | |")
            continue
        speed = f" ({base['step_s_mean'] / r['step_s_mean']:.2f}x)" if base else ""
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        table.append(f"| {r['variant']} | {opts} | {r['step_s_mean']:.2f}{speed} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {mfu} | "
                     f"{r['peak_gib']:.1f} |")
    text = "\n".join(table) + "\n"
    print(text)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(
        {"device": device, "size": args.size, "lengths": lengths, "flops": flops,
         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
