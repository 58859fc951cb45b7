"""Learner-only throughput: PolicyTrainer optimiser steps on synthetic GRPO batches, no engine.

    python -m bench.learner_bench --size 3b --variants legacy,rows,packed --out runs/learner
    python -m bench.learner_bench --size 7b --processes 2 --variants zero3-rows4,fsdp2-rows4

Each variant is one set of ``train.*`` options run in a fresh process (its own CUDA memory; an
out-of-memory variant is reported, not fatal) on the same batch: BATCH prompts x G completions of
PROMPT + completion tokens (``--lengths fixed``: every completion MAX tokens, as the throughput
benchmarks' ignore_eos; ``variable``: uniform in [MAX/8, MAX], as real GRPO). Timed: ``--steps``
optimiser steps after one warm-up; reported per variant: seconds per step, learner tokens/s
(prompt and completion tokens through the forward), model TFLOP/s and MFU
(pipeline.learner.flops, the same count for every variant) and peak GPU memory.

One process (VARIANTS): the model is read from disk. ``legacy`` runs the same steps with another
checkout's ``pipeline`` package (``--legacy-root``, e.g. ``git archive <commit> pipeline buffer
sync | tar -x -C .legacy``): before vs after in one run, on the same GPU.

``--processes N`` (DIST_VARIANTS): each variant is a fresh process group of N ranks started by
``accelerate launch``, the learner's own launcher (a ZeRO-3 accelerate config, or torchrun with
``train.fsdp2``); rank 0 drives the steps and the others ``follow()``, as in a run. The weights
are drawn at random on each rank's device from the model's config.json (no weights are read:
a 7B learner starts in seconds, and a step's cost does not depend on the values). MFU is over the
N GPUs' peak; peak memory is each rank's (reserved by the allocator, over the warm-up and the
timed steps). ``--budget`` shares one device call among the variants in the order given: a
variant that cannot get ``--min-variant-s`` is reported as not run. On CPU (gloo, DeepSpeed's CPU
accelerator) ``--size tiny`` checks the whole path in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from buffer.ports import free_port

clock = time.monotonic  # how main() shares --budget (a test replaces it)
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

# --processes N: how the learner is sharded ("zero3": examples/accelerate/zero3.yaml; "fsdp2":
# train.fsdp2), DeepSpeed's bf16 mode or not ("bf16": False runs fp32 weights under autocast),
# the train.* options and ZeRO settings over DeepSpeed's defaults ("zero").
CKPT = {"train.gradient_checkpointing": True}
ZERO_BUCKETS = {"stage3_prefetch_bucket_size": 500_000_000,
                "stage3_max_live_parameters": 2_000_000_000,
                "stage3_param_persistence_threshold": 1_000_000,
                "reduce_bucket_size": 500_000_000}


def _packed(tokens: int, ckpt: bool = True) -> dict[str, Any]:
    return {"train.packing": True, "train.micro_batch_tokens": tokens, **(CKPT if ckpt else {})}


DIST_VARIANTS: dict[str, dict[str, Any]] = {
    # The 7B colocated-2 run of BENCHMARKS.md: ZeRO-3 in DeepSpeed's bf16 mode, 4 rows a
    # micro-batch, DeepSpeed's default prefetch and bucket sizes.
    "zero3-rows4": {"shard": "zero3", "train": {"train.micro_batch": 4}},
    "zero3-fp32-rows4": {"shard": "zero3", "bf16": False, "train": {"train.micro_batch": 4}},
    "zero3-packed-4k": {"shard": "zero3", "train": _packed(4096, ckpt=False)},
    "zero3-packed-4k-ckpt": {"shard": "zero3", "train": _packed(4096)},
    "zero3-packed-16k-ckpt": {"shard": "zero3", "train": _packed(16384)},
    "zero3-packed-16k-ckpt-buckets": {"shard": "zero3", "train": _packed(16384),
                                      "zero": ZERO_BUCKETS},
    "zero3-packed-32k-ckpt": {"shard": "zero3", "train": _packed(32768)},
    "fsdp2-rows4": {"shard": "fsdp2", "train": {"train.micro_batch": 4}},
    "fsdp2-packed-4k": {"shard": "fsdp2", "train": _packed(4096, ckpt=False)},
    "fsdp2-packed-4k-ckpt": {"shard": "fsdp2", "train": _packed(4096)},
    "fsdp2-packed-16k-ckpt": {"shard": "fsdp2", "train": _packed(16384)},
    "fsdp2-packed-32k-ckpt": {"shard": "fsdp2", "train": _packed(32768)},
}
# The order a 7B call runs them in when it cannot run them all (run_gpu.sh learner7b).
DIST_DEFAULT = ("zero3-rows4,zero3-packed-16k-ckpt,fsdp2-packed-16k-ckpt,"
                "zero3-packed-16k-ckpt-buckets,fsdp2-packed-32k-ckpt,fsdp2-packed-4k,"
                "fsdp2-packed-4k-ckpt,fsdp2-rows4,zero3-fp32-rows4")


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
    from pipeline.launch.derive import resolve
    from pipeline.learner.trainer import PolicyTrainer

    over = {**BASE, "model.path": args.model, "run_dir": args.run_dir,
            "generation.group_size": args.group_size, **json.loads(args.options)}
    cfg = resolve(load_config(overrides=over))
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


def random_weights(device: str) -> None:
    """``from_pretrained`` of this process builds the model from its config.json with random
    weights drawn on ``device`` (under ZeRO-3's zero3_init_flag, transformers' zero.Init
    partitions them as they are drawn)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def from_pretrained(path: str, dtype: Any = torch.float32, **kwargs: Any) -> Any:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                    dtype=dtype, **kwargs)

    AutoModelForCausalLM.from_pretrained = from_pretrained


def dist_child(args: argparse.Namespace) -> None:
    """One rank of a --processes variant: rank 0 times the steps and prints one RESULT line;
    every rank writes its peak memory to RUN_DIR/rank<r>.json."""
    import torch

    import pipeline.learner.trainer as trainer_mod
    from pipeline.config import load_config
    from pipeline.learner import distributed as D

    t_start = time.monotonic()
    spec = DIST_VARIANTS[args.variant]
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    random_weights(f"cuda:{local}" if cuda else "cpu")
    zero = spec.get("zero") or {}
    if zero:  # ZeRO settings over DeepSpeed's defaults, before the engine is built
        configure = trainer_mod.configure_deepspeed

        def configure_with(c: dict, t: Any, world: int) -> int:
            c.setdefault("zero_optimization", {}).update(zero)
            return configure(c, t, world)

        trainer_mod.configure_deepspeed = configure_with
    over = {**BASE, "model.path": args.model, "run_dir": args.run_dir,
            "generation.group_size": args.group_size, "model.dtype": "bfloat16",
            "train.learner_processes": D.world_size(),
            "train.fsdp2": spec["shard"] == "fsdp2", **spec["train"]}
    cfg = load_config(overrides=over)
    trainer = trainer_mod.PolicyTrainer(cfg, args.model)
    init_s = time.monotonic() - t_start
    if cuda:
        torch.cuda.empty_cache()  # FSDP2 drew the full model before sharding it
        torch.cuda.reset_peak_memory_stats()
    if D.is_main():
        groups = synthetic_groups(args.batch, args.group_size, args.prompt, args.max_tokens,
                                  args.lengths, trainer.vocab_size)
        try:
            trainer.step(groups, 0)
            times, metrics = [], {}
            for _ in range(args.steps):
                t0 = time.perf_counter()
                metrics = trainer.step(groups, 0)
                times.append(time.perf_counter() - t0)  # step() synchronises the GPU
                if metrics["skipped_nonfinite"]:
                    raise RuntimeError("a step was skipped as non-finite")
        except BaseException:
            # The other rank may be inside a collective of the failed step: telling it to stop
            # would wait for ever. Ending this process makes torchrun end the group.
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)
        trainer.release_followers()
        print("RESULT " + json.dumps({"step_s": times, "init_s": init_s,
                                      "loss": metrics.get("loss/loss"),
                                      "grad_norm": metrics.get("grad_norm")}), flush=True)
    else:
        step = trainer._step

        def step_or_die(*a: Any) -> Any:
            # follow() logs a failed step and waits for the next command, which would leave
            # rank 0 waiting in a collective for ever: end the process group instead.
            try:
                return step(*a)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(3)

        trainer._step = step_or_die
        trainer.follow()
    gb = 1e9
    peak = {"alloc_gb": torch.cuda.max_memory_allocated() / gb if cuda else 0.0,
            "reserved_gb": torch.cuda.max_memory_reserved() / gb if cuda else 0.0,
            "init_s": init_s}
    (Path(args.run_dir) / f"rank{D.rank()}.json").write_text(json.dumps(peak))
    D.barrier()


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant: torchrun starts each rank in a
    session of its own, which killing the launcher's group would leave running."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        procs = []
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


def launch_flags(name: str, out: Path, cuda: bool) -> list[str]:
    """``accelerate launch`` flags of a --processes variant: ZeRO-3 through an accelerate
    config (examples/accelerate/zero3.yaml, bf16 as the variant says), FSDP2 as
    pipeline-train starts a multi-process learner without one (torchrun, one rank a GPU)."""
    import yaml

    spec = DIST_VARIANTS[name]
    if spec["shard"] == "fsdp2":
        return ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    root = Path(__file__).resolve().parents[1]
    conf = yaml.safe_load((root / "examples/accelerate/zero3.yaml").read_text())
    conf["mixed_precision"] = "bf16" if spec.get("bf16", True) else "no"
    conf["use_cpu"] = False
    path = out / f"{name}.accelerate.yaml"
    path.write_text(yaml.safe_dump(conf))
    return ["--config_file", str(path)]


def measure_dist(args: argparse.Namespace, name: str, timeout: float) -> dict[str, Any]:
    """One --processes variant in a process group of its own; killed as a group at
    ``timeout``."""
    import numpy as np
    import torch

    run_dir = args.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in run_dir.glob("rank*.json"):
        f.unlink()
    cuda = torch.cuda.is_available()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
           str(args.processes), "--num_machines", "1", "--main_process_port", str(free_port()),
           *launch_flags(name, args.out, cuda), "-m", "bench.learner_bench", "--child",
           "--variant", name, "--model", args.model, "--run-dir", str(run_dir),
           *[f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
             ("batch", "group-size", "prompt", "max-tokens", "lengths", "steps")]]
    env = dict(os.environ)
    if not cuda:
        # DeepSpeed's CPU accelerator compiles its shared-memory op on first use. A variant
        # killed mid-compile leaves torch's build lock behind, and every later build waits on it
        # for ever: ours build in a directory of their own, where no variant runs now, so any
        # lock there is stale.
        ext = Path.home() / ".cache" / "learner_bench_torch_extensions"
        for lock in [*ext.glob("*/lock"), *ext.glob("*/.ninja_lock")]:
            lock.unlink(missing_ok=True)
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
                   TORCH_EXTENSIONS_DIR=str(ext))
    log_path = args.out / f"{name}.log"
    t0 = time.monotonic()
    with log_path.open("w") as log_f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_f, text=True, env=env,
                             start_new_session=True)
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            try:
                stdout, _ = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a rank still holds the pipe: give up on it
                stdout = ""
            stdout += f"\n[learner_bench] killed after {timeout:.0f} s\n"
        log_f.write(stdout)
    wall = time.monotonic() - t0
    text = log_path.read_text()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"variant": name, "error": failure(text, timeout), "wall_s": wall}
    r = json.loads(lines[-1].removeprefix("RESULT "))
    ranks = sorted(run_dir.glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    r.update(variant=name, wall_s=wall, step_s_mean=float(np.mean(r["step_s"])),
             peaks=[json.loads(f.read_text()) for f in ranks])
    return r


def failure(log: str, timeout: float) -> str:
    """Why a variant left no result, in a few words, from its log: out of memory (on any
    rank), over its time, or the last error line."""
    if "out of memory" in log or "OutOfMemoryError" in log:
        return "out of memory"
    if "[learner_bench] killed after" in log:
        return f"over {timeout:.0f} s"
    last = next((ln for ln in reversed(log.splitlines()) if "Error" in ln), "failed")
    return last.strip()[:160]


def dist_table(args: argparse.Namespace, rows: list[dict], device: str, total_tokens: int
               ) -> str:
    head = (f"Learner alone, {args.size} over {args.processes} x {device}: {args.batch} prompts "
            f"x {args.group_size}, prompt {args.prompt} + completion {args.lengths} <= "
            f"{args.max_tokens} tokens ({total_tokens} tokens a step), {args.steps} timed steps "
            f"after 1 warm-up, random-init weights")
    out = [head, "", "| variant | sharding | train.* options | s/step | tokens/s | tokens/s per "
           "GPU | MFU | peak GB reserved per rank | start s | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in rows if "step_s_mean" in r), None)
    for r in rows:
        spec = DIST_VARIANTS[r["variant"]]
        shard = {"zero3": "ZeRO-3, " + ("bf16 weights" if spec.get("bf16", True)
                                         else "fp32 weights + autocast"),
                 "fsdp2": "FSDP2, bf16 compute"}[spec["shard"]]
        if spec.get("zero"):
            shard += ", " + ", ".join(f"{k.removeprefix('stage3_')}={v:.0e}"
                                      for k, v in spec["zero"].items())
        opts = ", ".join(f"{k.removeprefix('train.')}={v}" for k, v in spec["train"].items())
        if "error" in r:
            out.append(f"| {r['variant']} | {shard} | {opts} | {r['error']} | | | | | | "
                       f"{r.get('wall_s', 0):.0f} |")
            continue
        speed = f" ({base['step_s_mean'] / r['step_s_mean']:.2f}x)" if base else ""
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        peaks = " / ".join(f"{p['reserved_gb']:.1f}" for p in r["peaks"]) or "?"
        out.append(f"| {r['variant']} | {shard} | {opts} | {r['step_s_mean']:.2f}{speed} | "
                   f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / args.processes:,.0f} | "
                   f"{mfu} | {peaks} | {r['init_s']:.0f} | {r['wall_s']:.0f} |")
    return "\n".join(out) + "\n"


def prepare_model(size: str, processes: int) -> str:
    """The model directory of ``--size``: a directory as given; ``tiny`` the test model; a
    bench.gpu_model size with its weights (one process reads them) or, for --processes, its
    config and tokenizer only (the ranks draw the weights)."""
    if Path(size).is_dir():
        return str(Path(size).resolve())
    if size == "tiny":
        from pipeline.models import build_tiny_model

        return str(build_tiny_model(Path("/tmp/bench-models/tiny")))
    if processes > 1:
        from bench.gpu_model import SIZES, copy_tokenizer, write_config

        path = Path(f"/tmp/bench-models/{size}-config")
        if not (path / "tokenizer.json").is_file():
            write_config(path, SIZES[size])
            copy_tokenizer(path)
        return str(path)
    path = Path(f"/tmp/bench-models/{size}")
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "bench.gpu_model", str(path), "--size", size],
                       check=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="3b",
                   help="bench.gpu_model size, 'tiny' (the test model), or a model directory")
    p.add_argument("--processes", type=int, default=1,
                   help="learner ranks per variant (> 1: DIST_VARIANTS, one GPU each)")
    p.add_argument("--variants", default=None, help="comma-separated; default: "
                   "legacy,rows,packed-16k (one process) or DIST_DEFAULT (--processes)")
    p.add_argument("--batch", type=int, default=16, help="prompts (groups) per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lengths", choices=["fixed", "variable"], default="fixed")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--legacy-root", default=".legacy")
    p.add_argument("--variant-timeout", type=float, default=240)
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for all variants together (0: no limit); each variant gets "
                   "at most what is left")
    p.add_argument("--min-variant-s", type=float, default=60,
                   help="a variant is not started with less than this left of --budget")
    p.add_argument("--out", type=Path, default=Path("runs/learner"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        (dist_child if args.variant else child)(args)
        return 0
    t_start = clock()
    dist = args.processes > 1
    table_of = DIST_VARIANTS if dist else VARIANTS
    names = (args.variants or (DIST_DEFAULT if dist else "legacy,rows,packed-16k")).split(",")
    unknown = [n for n in names if n not in table_of]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(table_of)}")
    from types import SimpleNamespace

    from pipeline.learner.flops import ModelShape, train_flops

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if not dist and "legacy" in names:
        legacy = Path(args.legacy_root) / "bench"
        legacy.mkdir(parents=True, exist_ok=True)
        (legacy / "learner_bench.py").write_text(Path(__file__).read_text())
        (legacy / "__init__.py").touch()
    args.model = prepare_model(args.size, args.processes)
    # config.json as it is (no transformers import in this parent: the ranks import it).
    hf = json.loads((Path(args.model) / "config.json").read_text())
    shape = ModelShape.from_config(SimpleNamespace(**{**(hf.get("text_config") or {}), **hf}))
    lengths = [args.prompt + len(c.token_ids) for g in synthetic_groups(
        args.batch, args.group_size, args.prompt, args.max_tokens, args.lengths,
        shape.vocab) for c in g.completions]
    loss_tokens = sum(lengths) - args.prompt * len(lengths)
    flops = train_flops(shape, lengths, loss_tokens)
    device, peak = peak_gpu_flops()
    if peak:
        peak *= args.processes
    rows: list[dict] = []
    for name in names:
        left = args.variant_timeout
        if args.budget:
            left = min(left, args.budget - (clock() - t_start))
        if left < args.min_variant_s:
            r = {"variant": name, "error": f"not run: {max(left, 0):.0f} s left of --budget"}
        else:
            r = measure_dist(args, name, left) if dist else measure(args, name)
        if "step_s_mean" in r:
            s = r["step_s_mean"]
            r.update(tokens_per_s=sum(lengths) / s, tflops=flops / s / 1e12,
                     mfu=flops / s / peak if peak else None)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "step_s"}), flush=True)
        # Written after every variant: a call cut short still leaves the rows it finished.
        text = dist_table(args, rows, device, sum(lengths)) if dist else \
            single_table(args, rows, device, lengths)
        (args.out / "results.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(
            {"device": device, "size": args.size, "processes": args.processes,
             "lengths": lengths, "flops": flops, "rows": rows}, indent=1))
    print(text)
    return 0


def peak_gpu_flops() -> tuple[str, float | None]:
    """This machine's GPU name ("cpu" without one) and its dense bf16 peak (None if unknown)."""
    import torch

    from pipeline.learner.flops import peak_flops

    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name(0)
    return name, peak_flops(name)


def single_table(args: argparse.Namespace, rows: list[dict], device: str, lengths: list[int]
                 ) -> str:
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
    return "\n".join(table) + "\n"


if __name__ == "__main__":
    sys.exit(main())
