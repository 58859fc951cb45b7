"""The peer in issue 7's benchmark: TRL's GRPOTrainer on our model, prompts, reward and batch.

Runs ``trl.GRPOTrainer`` for ``--steps`` optimiser steps with the settings our trainer uses
(arithmetic prompts rendered through the tokenizer's chat template, ``pipeline.tasks.rewards:
exact_match``, ``--batch-groups`` prompts x ``--group-size`` completions per step, one optimiser
step per generation batch, i.e. on-policy, no KL, PPO clip 0.2/0.28, token-mean loss, AdamW at
``--lr`` with a constant schedule, grad-norm clip 1.0, fp32 master weights with bf16 autocast on
GPUs) and writes one JSON file with wall time, per-step times, throughput, the reward curve with
wall-clock timestamps, weight-sync and generation/training times.

Generation, as TRL users pick it (``--vllm-mode``):
- ``colocate``: vLLM in the trainer process on the trainer's GPU (GRPOConfig ``vllm_mode=
  "colocate"``, ``vllm_gpu_memory_utilization``, optional ``vllm_enable_sleep_mode``);
- ``server``: this script starts ``trl vllm-serve`` (``python -m trl.scripts.vllm_serve``) with
  ``CUDA_VISIBLE_DEVICES=--server-gpus``, waits for its /health, points the trainer at it and
  stops its whole process group at the end (no orphan, also on errors and SIGTERM); the trainer
  must then see only its own GPU (``--trainer-gpus``), or TRL refuses its 2-GPU DataParallel;
- ``none``: ``model.generate`` in the trainer (slow; for CPU smoke tests).

Where the times come from: step times from a TrainerCallback (``on_step_end`` wall clock);
generation, weight-sync and scoring times from TRL's own ``profiling_context`` timers
(``GRPOTrainer.vLLM.generate``, ``.sync_weights``, ``._prepare_inputs`` ...), which TRL only sends
to wandb/mlflow/trackio, so this script also records them by wrapping
``ProfilingContext._log_metrics``. Reward and completion lengths come from TRL's per-step logs
(``logging_steps=1``).

Usage (repo root): ``python bench/trl_grpo.py --model DIR --vllm-mode colocate --steps 20 --out
runs/bench/trl_colocate.json``. Everything TRL-specific is imported inside functions, so
``--help`` and the pure helpers (tested in tests/unit/test_trl_bench_args.py) need no TRL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.trl_runner import (
    add_batch_args,
    check_batch,
    check_gpus_apart,
    number,
    package_versions,
    run_main,
    serving,
    trainer_kwargs,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/trl_grpo.py`: make examples/ importable
    sys.path.insert(0, str(REPO_ROOT))

# TRL profiling names (``f"{trainer class}.{name}"``) this script reads.
P_GENERATE = ("GRPOTrainer.vLLM.generate", "GRPOTrainer.transformers.generate",
              "GRPOTrainer.transformers.generate_batch")
P_SYNC = "GRPOTrainer.sync_weights"
P_PREPARE = "GRPOTrainer._prepare_inputs"   # generation + sync + scoring (+ old logps if any)
P_REWARDS = "GRPOTrainer._calculate_rewards"


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/trl_grpo.py",
        description="Benchmark TRL's GRPOTrainer on our task (the peer of issue 7).")
    p.add_argument("--model", required=True, help="local HF model directory (no hub)")
    p.add_argument("--vllm-mode", choices=("colocate", "server", "none"), default="colocate",
                   help="TRL generation backend: vLLM colocated, vLLM server, or model.generate")
    add_batch_args(p, steps=20, batch_groups=8, max_tokens=64)
    p.add_argument("--ignore-eos", action="store_true",
                   help="fixed-length generations of exactly --max-tokens (throughput runs)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (constant)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="completions per forward/backward (per_device_train_batch_size); must "
                        "divide batch-groups x group-size (default: the largest divisor <= 16, "
                        "our train.micro_batch)")
    p.add_argument("--task", choices=("arithmetic",), default="arithmetic",
                   help="prompt set + reward: pipeline/tasks/arithmetic.py + rewards.exact_match")
    p.add_argument("--num-prompts", type=int, default=2000,
                   help="arithmetic prompts (the same records as our data.path arithmetic:N)")
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--no-chat-template", action="store_true",
                   help="plain-text prompts (default: chat template when the tokenizer has one)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="autocast precision (default: bf16 on CUDA, fp32 on CPU); master weights "
                        "are fp32 either way, as in our learner")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="vLLM context length (prompt + completion)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=None,
                   help="colocate: vLLM share of the trainer GPU (default 0.3); server: of the "
                        "server GPU (default 0.9); TRL's defaults for each")
    p.add_argument("--vllm-enable-sleep-mode", action="store_true",
                   help="colocate: vLLM sleeps (frees weights + KV cache) during training")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="TRL's gradient_checkpointing (what a full fine-tune needs to fit one "
                        "card beside its engine at 1.5B and up)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train a peft LoRA adapter of this rank on every projection (0: full)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="server: start vLLM with --enforce-eager (TRL's default is CUDA graphs; "
                        "TRL's colocate mode has no such option)")
    p.add_argument("--server-gpus", default="1",
                   help="server: CUDA_VISIBLE_DEVICES of the vLLM server")
    p.add_argument("--trainer-gpus", default=None,
                   help="CUDA_VISIBLE_DEVICES of the trainer, set before torch is imported "
                        "(default: inherited). Give it one GPU on a multi-GPU machine: a "
                        "trainer that sees 2 GPUs gets n_gpu=2, and GRPOTrainer refuses "
                        "nn.DataParallel")
    p.add_argument("--server-port", type=int, default=8000)
    p.add_argument("--server-group-port", type=int, default=51216,
                   help="server: NCCL port of the weight-update group")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="server: seconds to wait for the server's /health")
    p.add_argument("--server-url", default=None,
                   help="server: use an already running `trl vllm-serve` at this URL instead of "
                        "starting one")
    p.add_argument("--server-log", type=Path, default=None,
                   help="server: its stdout/stderr (default: next to --out)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="TRL output_dir (nothing is saved; default: next to --out)")
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Raise ValueError with the option's name for settings TRL would reject later (or worse,
    silently change)."""
    total = check_batch(args, ("steps", "batch_groups", "max_tokens", "num_prompts",
                               "max_model_len", "server_port"))
    if args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if total % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} must divide batch-groups x group-size "
                         f"= {total} (one optimiser step per generation batch)")
    if args.vllm_gpu_memory_utilization is None:
        args.vllm_gpu_memory_utilization = 0.9 if args.vllm_mode == "server" else 0.3
    if not 0.0 < args.vllm_gpu_memory_utilization <= 1.0:
        raise ValueError("--vllm-gpu-memory-utilization must be in (0, 1]")
    if args.max_tokens >= args.max_model_len:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for the prompt in "
                         f"--max-model-len {args.max_model_len}")
    if args.vllm_enable_sleep_mode and args.vllm_mode != "colocate":
        raise ValueError("--vllm-enable-sleep-mode applies to --vllm-mode colocate only")
    if args.vllm_mode == "server":
        check_gpus_apart(args)


def grpo_config_kwargs(args: argparse.Namespace, *, cuda: bool, output_dir: str,
                       server_url: str | None = None) -> dict[str, Any]:
    """GRPOConfig keyword arguments that reproduce our trainer's settings (see module docstring).

    One generation batch = batch_groups x group_size completions = one optimiser step:
    per_device_train_batch_size x gradient_accumulation_steps (steps_per_generation defaults to
    the latter), num_iterations 1, so every step is on-policy and weights sync every step.
    """
    bf16 = (args.dtype == "bf16") if args.dtype else cuda
    gen_kwargs: dict[str, Any] = {}
    if args.ignore_eos:
        # vLLM's SamplingParams.ignore_eos; transformers' generate has no such flag, but
        # min_new_tokens = max_new_tokens suppresses EOS until the end (the same effect).
        gen_kwargs = ({"ignore_eos": True} if args.vllm_mode != "none"
                      else {"min_new_tokens": args.max_tokens})
    kw: dict[str, Any] = dict(
        trainer_kwargs(args, cuda=cuda, output_dir=output_dir),
        num_iterations=1,
        beta=0.0,
        loss_type="dapo",          # token mean over the whole step's batch = our agg token_mean
        scale_rewards="group",
        generation_kwargs=gen_kwargs or None,
        bf16=bf16,
        # fp32 master weights, as ours; a LoRA base is frozen: bf16, as ours on a GPU
        model_init_kwargs={"dtype": "bfloat16" if args.lora_rank and bf16 else "float32"},
        logging_first_step=True,
        use_vllm=args.vllm_mode != "none",
        gradient_checkpointing=args.gradient_checkpointing,
    )
    if args.vllm_mode == "colocate":
        kw.update(vllm_mode="colocate",
                  vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  vllm_max_model_length=args.max_model_len,
                  vllm_enable_sleep_mode=args.vllm_enable_sleep_mode)
    elif args.vllm_mode == "server":
        kw.update(vllm_mode="server",
                  vllm_server_base_url=server_url or f"http://127.0.0.1:{args.server_port}",
                  vllm_group_port=args.server_group_port,
                  vllm_server_timeout=args.server_timeout)
    return kw


def lora_config(rank: int) -> Any:
    """peft's LoraConfig on the projections our runs adapt (train.lora_target_modules' default,
    alpha 16), or None for a full fine-tune."""
    if rank <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


# ----------------------------------------------------------------------------- data + reward


def arithmetic_dataset_rows(num_prompts: int, max_operand: int,
                            chat: bool) -> list[dict[str, Any]]:
    """Our trainer's arithmetic records
    (``pipeline.producer.data.load_records('arithmetic:N[:M]')``:
    make_arithmetic_prompts with seed 1234) as TRL dataset rows. ``chat``: a conversational
    prompt (one user message; TRL applies the chat template with add_generation_prompt, as our
    ``render_prompt`` does), else the plain text."""
    from pipeline.tasks.arithmetic import make_arithmetic_prompts
    records = make_arithmetic_prompts(num_prompts, seed=1234, max_operand=max_operand)
    return [{"prompt": [{"role": "user", "content": r["prompt"]}] if chat else r["prompt"],
             "answer": r["answer"], "prompt_id": r["prompt_id"]} for r in records]


def _text(x: Any) -> str:
    """TRL passes conversational prompts/completions as message lists; ours are strings."""
    if isinstance(x, list):
        return "".join(str(m.get("content", "")) for m in x if isinstance(m, dict))
    return str(x)


def exact_match_reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    """pipeline.tasks.rewards.exact_match in TRL's reward-function signature (batched)."""
    from pipeline.tasks.rewards import exact_match
    return [exact_match(_text(p), _text(c), answer=a)
            for p, c, a in zip(prompts, completions, answer, strict=True)]


# ----------------------------------------------------------------------------- measurement


@dataclass
class Recorder:
    """Wall-clock marks of the run and TRL's profiling timers, attributed to steps.

    ``step`` is the 1-based optimiser step in progress (0 before training starts); a profiling
    interval counts for the step during which it ended.
    """

    t0: float = field(default_factory=time.perf_counter)
    unix0: float = field(default_factory=time.time)
    step: int = 0
    train_begin: float | None = None
    step_end: dict[int, float] = field(default_factory=dict)
    logs: dict[int, dict[str, Any]] = field(default_factory=dict)
    prof: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(
        lambda: defaultdict(float)))
    prof_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def on_profile(self, name: str, duration: float) -> None:
        self.prof[self.step][name] += duration
        self.prof_calls[name] += 1


def install_profiling_hook(rec: Recorder) -> None:
    """Also record TRL's profiling_context durations (TRL sends them only to wandb etc.)."""
    from trl.extras import profiling

    original = profiling.ProfilingContext._log_metrics

    def _log_metrics(self, duration: float) -> None:
        rec.on_profile(self.name, duration)
        original(self, duration)

    profiling.ProfilingContext._log_metrics = _log_metrics


def make_callback(rec: Recorder):
    from transformers import TrainerCallback

    class _Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            rec.train_begin = rec.now()
            rec.step = 1

        def on_step_end(self, args, state, control, **kw):
            rec.step_end[state.global_step] = rec.now()
            rec.step = state.global_step + 1

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:   # the per-step training log (not the final summary)
                rec.logs[state.global_step] = dict(logs)

    return _Marks()



def summarize(rec: Recorder, *, steps: int, samples_per_step: int,
              max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Per-step rows and run totals from the recorder (pure; unit-tested)."""
    rows: list[dict[str, Any]] = []
    prev = rec.train_begin if rec.train_begin is not None else 0.0
    for s in range(1, steps + 1):
        if s not in rec.step_end:
            break
        end = rec.step_end[s]
        log = rec.logs.get(s, {})
        prof = rec.prof.get(s, {})
        # A step's log holds the mean completion length of its (single) generation batch.
        mean_len = number(log.get("completions/mean_length"))
        if mean_len is None and ignore_eos:
            mean_len = float(max_tokens)
        gen = sum(prof.get(n, 0.0) for n in P_GENERATE) if any(n in prof for n in P_GENERATE) \
            else None
        prep = prof.get(P_PREPARE)
        step_time = end - prev
        rows.append({
            "step": s,
            "t_s": round(end, 4),                       # since script start
            "t_train_s": round(end - (rec.train_begin or 0.0), 4),
            "unix_time": round(rec.unix0 + end, 3),
            "step_time_s": round(step_time, 4),
            "reward": number(log.get("reward")),
            "reward_std": number(log.get("reward_std")),
            "completion_tokens": (round(mean_len * samples_per_step)
                                  if mean_len is not None else None),
            "mean_completion_length": mean_len,
            "generate_s": gen,
            "sync_weights_s": prof.get(P_SYNC),
            "rewards_s": prof.get(P_REWARDS),
            "prepare_inputs_s": prep,
            # forward + backward + optimiser: the step minus TRL's generation/scoring phase
            "train_s": (step_time - prep) if prep is not None else None,
            "loss": number(log.get("loss")),
            "grad_norm": number(log.get("grad_norm")),
            "clip_ratio": number(log.get("clip_ratio/region_mean")),
            "trl_step_time_s": number(log.get("step_time")),
        })
        prev = end

    def total(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return sum(vals) if vals else None

    def rates(sel: list[dict[str, Any]]) -> dict[str, Any]:
        wall = sum(r["step_time_s"] for r in sel)
        toks = [r["completion_tokens"] for r in sel]
        tok_total = sum(toks) if sel and None not in toks else None
        return {
            "steps": len(sel),
            "wall_s": round(wall, 4),
            "trained_samples_per_s": (len(sel) * samples_per_step / wall) if wall > 0 else None,
            "completion_tokens_per_s": (tok_total / wall) if wall > 0 and tok_total else None,
            "completion_tokens": tok_total,
        }

    syncs = [r["sync_weights_s"] for r in rows if r["sync_weights_s"] is not None]
    # bench/gpu_bench.py reads these rows (its metrics-row names; ts = unix time at step end).
    compat = [{"step": r["step"], "ts": r["unix_time"], "step_s": r["step_time_s"],
               "trained_tokens": r["completion_tokens"], "reward_mean": r["reward"],
               "sync_s": r["sync_weights_s"], "generate_s": r["generate_s"],
               "train_s": r["train_s"]} for r in rows]
    return {
        "steps_done": len(rows),
        "startup_s": rec.train_begin,                # model load + vLLM start (+ server wait)
        "train_wall_s": (rows[-1]["t_s"] - rec.train_begin) if rows and rec.train_begin is not None
        else None,
        "samples_per_step": samples_per_step,
        "throughput": rates(rows),
        # step 1 carries warm-up (first vLLM requests, CUDA kernels): report without it too
        "throughput_after_first_step": rates(rows[1:]),
        "weight_sync": {
            "per_step_s": [r["sync_weights_s"] for r in rows],
            "mean_s": (sum(syncs) / len(syncs)) if syncs else None,
            "max_s": max(syncs) if syncs else None,
            "note": ("TRL's profiling timer 'sync_weights' around vllm_generation.sync_weights() "
                     "(runs before each generation whose weights are stale)") if syncs else
                    "no weight sync: generation uses the training model itself (vllm-mode none)",
        },
        "time_split": {
            "generate_s": total("generate_s"),
            "sync_weights_s": total("sync_weights_s"),
            "rewards_s": total("rewards_s"),
            "prepare_inputs_s": total("prepare_inputs_s"),
            "train_s": total("train_s"),
            "note": "generate_s: TRL's vLLM.generate/transformers.generate timers; "
                    "prepare_inputs_s: TRL's _prepare_inputs (generation + weight sync + reward + "
                    "advantages); train_s = step wall time - prepare_inputs_s (forward, backward, "
                    "optimiser, logging). Colocate/none: one GPU does both in turn; server: the "
                    "trainer GPU waits during generate_s.",
        },
        "per_step": rows,
        "steps": compat,
    }


# ----------------------------------------------------------------------------- run


def run(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """Fill ``result`` (also on failure: what was measured until then)."""
    rec = Recorder()
    if args.vllm_mode == "colocate" and not os.environ.get("MASTER_PORT"):
        # vLLM's external_launcher rendezvous uses MASTER_PORT; on CPU accelerate would pin it to
        # 29500, which another job on the machine may hold.
        from buffer.ports import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    out_dir = args.out.resolve().parent
    workdir = args.workdir or out_dir / f"{args.out.stem}.trl"
    notes: list[str] = []
    result.update(framework="trl", vllm_mode=args.vllm_mode,
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    try:
        started = args.vllm_mode == "server"
        with serving(args, result, "trl-bench", out_dir, start=started) as server_url:
            import torch
            from datasets import Dataset
            from transformers import AutoTokenizer
            from trl import GRPOConfig, GRPOTrainer

            install_profiling_hook(rec)
            cuda = torch.cuda.is_available()
            tokenizer = AutoTokenizer.from_pretrained(args.model)
            chat = not args.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
            if not chat and not args.no_chat_template:
                notes.append("tokenizer has no chat template: plain-text prompts "
                             "(as our render_prompt)")
            rows = arithmetic_dataset_rows(args.num_prompts, args.max_operand, chat)
            cfg_kw = grpo_config_kwargs(args, cuda=cuda, output_dir=str(workdir),
                                        server_url=server_url)
            config = GRPOConfig(**cfg_kw)
            trainer = GRPOTrainer(model=str(args.model), reward_funcs=exact_match_reward,
                                  args=config, train_dataset=Dataset.from_list(rows),
                                  processing_class=tokenizer, callbacks=[make_callback(rec)],
                                  peft_config=lora_config(args.lora_rank))
            result["grpo_config"] = {k: v for k, v in cfg_kw.items() if k != "output_dir"}
            result["grpo_config"].update(
                steps_per_generation=config.steps_per_generation,
                generation_batch_size=config.generation_batch_size,
                vllm_importance_sampling_correction=getattr(
                    config, "vllm_importance_sampling_correction", None))
            if args.vllm_mode == "colocate":
                notes.append("colocate: TRL builds vLLM.LLM itself (CUDA graphs on, "
                             "max_num_batched_tokens=4096, no enforce_eager option)")
            result["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
            trainer.train()
    finally:
        result.update(summarize(rec, steps=args.steps,
                                samples_per_step=args.batch_groups * args.group_size,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos))
        result["profiling_calls"] = dict(rec.prof_calls)
        result["total_wall_s"] = rec.now()
        result["versions"] = package_versions()
        result["notes"] = notes
    return result


SUMMARY = ("[trl-bench] {steps_done} steps in {train_wall_s} s; "
           "{throughput[trained_samples_per_s]} samples/s, "
           "{throughput[completion_tokens_per_s]} tok/s")


def main(argv: list[str] | None = None) -> int:
    return run_main("trl_grpo", build_parser(), argv, validate_args, run, SUMMARY)


if __name__ == "__main__":
    raise SystemExit(main())
