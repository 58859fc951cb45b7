"""The async peer of issue 26: TRL's AsyncGRPOTrainer on our model, prompts, reward and batch.

Runs ``trl.experimental.async_grpo.AsyncGRPOTrainer`` (trl 1.16) for ``--steps`` optimiser steps
on the job ``bench.gpu_bench`` gives our runs, and writes one JSON file with TRL's own per-step
metrics (throughput, MFU, weight sync, staleness) and the rows ``bench.gpu_bench`` reads.

How TRL runs it, and what this script does for it:
- generation is a ``vllm serve`` started by ``python -m trl.scripts.vllm_serve`` (NCCL weight
  transfer, dev mode), here on ``--server-gpus`` in its own process group, stopped at the end
  (bench.trl_runner.VllmServer); the trainer sees only ``--trainer-gpus`` (the split layout);
- its rollout worker is a spawned child (``/v1/completions`` over HTTP, rewards scored there), so
  this module is run as ``python -m bench.trl_async`` behind a ``__main__`` guard, and the reward
  is a picklable module-level object (``ExactMatchReward``);
- the worker's requests carry no ``ignore_eos``; for fixed-length completions (``--ignore-eos``,
  as our throughput runs) the reward object, when unpickled in that child, wraps the worker's
  HTTP post so that every ``/v1/completions`` request asks for it (``install_ignore_eos``);
- the worker applies the chat template to every prompt (prompts are conversational here) and
  parses each completion with the tokenizer's response schema: our byte-level tokenizer's template
  is unknown to TRL, so it gets a plain-content ``response_template`` (and legacy
  ``response_schema``; ``prepare_tokenizer``), left padding and a pad token;
- the trainer packs each micro-batch as a prefix tree and runs attention with the FA3 kernel of the
  ``kernels`` package, fetched from the Hub at first use, which the GPU machine cannot reach:
  ``--attention torch`` (default) puts torch's own varlen flash attention
  (``torch.nn.attention.varlen``, FA2 kernels) behind the same call (``TorchVarlenAttention``);
  ``--attention fa3`` keeps TRL's kernel where it is cached.

Like for like with our async runs: ``--max-staleness`` (TRL drops a sample older than that many
weight versions; default 1 = our async1), one weight sync per optimiser step, exactly
``--batch-groups`` x ``--group-size`` samples per step (``token_budget <= 0``: fixed-count
micro-batches of ``--micro-batch``, our train.micro_batch, with gradient accumulation over the
step), AdamW at ``--lr`` constant, grad-norm clip 1.0, PPO clip 0.2/0.28, no KL, fp32 master
weights with bf16 autocast, gradient checkpointing off (ours has none).

TRL's metrics read (its ``_log_step_metrics``; one log per step): ``perf/step_s``,
``perf/trained_tok_s_wall_clock``, ``perf/mfu_wall_clock`` and ``perf/mfu_fwd_bwd`` (percent, its
``compute_flops_per_token`` over forwarded tokens: prompt + completion),
``perf/weight_sync_s``, ``perf/rollout_wait_s``, ``batch/trained_tokens_per_step``,
``batch/samples_per_step``, ``sample/staleness_mean|max``, ``sample/dropped_stale_total``,
``reward``.

Usage (repo root): ``python -m bench.trl_async --model DIR --out runs/bench/trl-async.json
--server-gpus 0 --trainer-gpus 1``. TRL is imported inside functions only, so ``--help`` and the
pure helpers (tests/unit/bench/test_trl_async.py) need no TRL.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from pathlib import Path
from typing import Any

from bench import trl_runner
from bench.trl_grpo import arithmetic_dataset_rows, exact_match_reward

# Response parsers whose whole text is the content: completions carry no tool calls here, and TRL
# parses each with the tokenizer's (``tokenizer.parse_response``), which raises for a chat template
# TRL does not know. transformers >= 5.13 reads ``response_template`` (and, at 5.19, only that:
# without it parse_response raises AttributeError, which TRL does not catch); older ones read the
# legacy ``response_schema``. Both are set.
PLAIN_RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"},
                           "fields": {"content": {"content": "text"}}}
PLAIN_RESPONSE_SCHEMA = {
    "x-regex": r"^(?P<content>[\s\S]*)$",
    "type": "object",
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
}

# TRL log key -> our metrics-row key (bench.gpu_bench reads the row keys).
TRL_KEYS = {
    "perf/step_s": "trl_step_s",
    "perf/trained_tok_s_wall_clock": "trl_trained_tok_s",
    "perf/forwarded_tok_s_wall_clock": "trl_forwarded_tok_s",
    "perf/mfu_wall_clock": "mfu_wall_pct",
    "perf/mfu_fwd_bwd": "mfu_fwd_bwd_pct",
    "perf/fwd_bwd_s": "train_s",
    "perf/weight_sync_s": "sync_s",
    "perf/rollout_wait_s": "rollout_wait_s",
    "batch/trained_tokens_per_step": "trained_tokens",
    "batch/forwarded_tokens_per_step": "forwarded_tokens",
    "batch/samples_per_step": "samples",
    "sample/staleness_mean": "staleness_mean",
    "sample/staleness_max": "staleness_max",
    "sample/dropped_stale_total": "dropped_stale",
    "reward": "reward_mean",
    "completions/mean_length": "completion_len_mean",
    "completions/min_length": "completion_len_min",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "clip_ratio/region_mean": "clip_ratio",
}


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.trl_async",
                                description="Benchmark TRL's AsyncGRPOTrainer on our task.")
    p.add_argument("--model", required=True, help="local HF model directory (no hub)")
    trl_runner.add_batch_args(p, steps=12, batch_groups=16, max_tokens=256)
    p.add_argument("--ignore-eos", action="store_true",
                   help="fixed-length completions of exactly --max-tokens (throughput runs)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant)")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="TRL's max_staleness: weight versions a sample may lag (ours: async1 = 1)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per forward/backward (default: the largest divisor <= 16 of a "
                        "step's samples, our train.micro_batch)")
    p.add_argument("--token-budget", type=int, default=0,
                   help="TRL's token_budget; <= 0 (default): fixed-count micro-batches of "
                        "--micro-batch, so a step is exactly batch-groups x group-size samples")
    p.add_argument("--attention", choices=("torch", "fa3"), default="torch",
                   help="tree attention kernel: torch's varlen flash attention (no hub needed) "
                        "or TRL's FA3 from the kernels package (hub or its cache)")
    p.add_argument("--weight-sync", choices=("nccl", "none"), default="nccl",
                   help="nccl: TRL's weight transfer into the server (the benchmark); none: the "
                        "server keeps its first weights (CPU checks of everything else: NCCL "
                        "needs GPUs)")
    p.add_argument("--num-prompts", type=int, default=4000)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true",
                   help="start vLLM with --enforce-eager (default: CUDA graphs)")
    p.add_argument("--server-gpus", default="0", help="CUDA_VISIBLE_DEVICES of the vLLM server")
    p.add_argument("--trainer-gpus", default=None,
                   help="CUDA_VISIBLE_DEVICES of the trainer (one GPU), set before torch loads")
    p.add_argument("--server-port", type=int, default=8000)
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--server-url", default=None,
                   help="an already running TRL vLLM server instead of starting one")
    p.add_argument("--server-log", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None,
                   help="TRL output_dir (nothing is saved; default: next to --out)")
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the option for settings TRL would reject later or change."""
    total = trl_runner.check_batch(args, ("steps", "batch_groups", "max_tokens", "num_prompts",
                               "max_model_len"))
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {args.max_staleness}")
    if args.micro_batch < 1 or total % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} must divide batch-groups x group-size "
                         f"= {total} (a step is exactly one batch)")
    if args.max_tokens >= args.max_model_len:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for the prompt in "
                         f"--max-model-len {args.max_model_len}")
    if not 0.0 < args.vllm_gpu_memory_utilization <= 1.0:
        raise ValueError("--vllm-gpu-memory-utilization must be in (0, 1]")
    trl_runner.check_gpus_apart(args)


def async_config_kwargs(args: argparse.Namespace, *, cuda: bool, output_dir: str,
                        server_url: str) -> dict[str, Any]:
    """AsyncGRPOConfig keyword arguments for our job (see the module docstring)."""
    return dict(
        trl_runner.trainer_kwargs(args, cuda=cuda, output_dir=output_dir),
        dtype="float32",           # fp32 master weights, as our learner ...
        bf16=cuda,                 # ... with bf16 autocast on GPUs
        gradient_checkpointing=False,
        max_staleness=args.max_staleness,
        max_inflight_tasks=-1,     # TRL's auto: max(max_staleness, 1) x samples per step
        weight_sync_steps=1,
        token_budget=args.token_budget,
        vllm_server_base_url=server_url,
        vllm_server_timeout=args.server_timeout,
    )


# ----------------------------------------------------------------------------- rollout child


def install_ignore_eos() -> bool:
    """Make TRL's rollout worker ask vLLM for ``ignore_eos`` on every ``/v1/completions``
    request (vLLM's extra sampling parameter), by wrapping ``_AsyncRolloutLoop._post``. Idempotent;
    returns whether it patched now."""
    from trl.experimental.async_grpo import async_rollout_worker as worker

    cls = worker._AsyncRolloutLoop
    if getattr(cls._post, "_bench_ignore_eos", False):
        return False
    post = cls._post

    async def _post(self, path, payload, *a, **kw):
        if path.rstrip("/").endswith("/v1/completions"):
            payload = {**payload, "ignore_eos": True}
        return await post(self, path, payload, *a, **kw)

    _post._bench_ignore_eos = True
    cls._post = _post
    return True


class ExactMatchReward:
    """``bench.trl_grpo.exact_match_reward`` as a picklable object for TRL's spawned rollout
    child; with ``ignore_eos``, unpickling it there (before the rollout loop starts) installs
    ``install_ignore_eos`` in that process."""

    __name__ = "exact_match"

    def __init__(self, ignore_eos: bool = False):
        self.ignore_eos = ignore_eos

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.ignore_eos:
            install_ignore_eos()

    def __call__(self, prompts: list, completions: list, answer: list, **kw: Any) -> list[float]:
        return exact_match_reward(prompts, completions, answer)


def prepare_tokenizer(tokenizer: Any) -> Any:
    """What TRL's async trainer needs of a tokenizer whose chat template it does not know: a
    response parser (PLAIN_RESPONSE_TEMPLATE), left padding, a pad token."""
    if (getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None):
        tokenizer.response_template = PLAIN_RESPONSE_TEMPLATE
        tokenizer.response_schema = PLAIN_RESPONSE_SCHEMA
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ----------------------------------------------------------------------------- tree attention


class TorchVarlenAttention:
    """Stands in for the FA3 kernel module TRL's tree attention calls (``flash_attn_varlen_func``
    with packed ``(tokens, heads, dim)`` tensors and cumulative segment lengths): torch's
    ``varlen_attn`` on CUDA (flash attention 2 kernels of torch itself), else one SDPA per segment.
    Causal masks are aligned bottom-right (a segment's queries are the last of its keys), as FA's.
    """

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=None, **_: Any):
        if softcap:
            raise NotImplementedError("--attention torch: no logit softcap (use --attention fa3)")
        if (window_size[0] >= 0 or window_size[1] >= 0) and (window_size[1] != 0 or not causal):
            raise NotImplementedError(f"--attention torch: window {window_size}")
        if q.is_cuda:
            return _varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                int(max_seqlen_k), softmax_scale, causal, window_size[0])
        return varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                window_size[0])


def _varlen_cuda(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if q.shape[1] != k.shape[1] and "enable_gqa" not in params:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None:  # the kernel's own scale is 1/sqrt(head_dim): fold ours into q
        q = q * (scale * q.shape[-1] ** 0.5)
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    if "window_size" in params:  # torch >= 2.11
        kw["window_size"] = (left, 0) if causal else (-1, -1)
    else:  # torch 2.10
        if left >= 0:
            raise NotImplementedError("sliding windows need torch >= 2.11")
        kw["is_causal"] = causal
    import torch

    # FA kernels want the head dim contiguous; TRL hands over a transposed view of the queries
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(),
                       cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32), max_q,
                       max_k, **kw)


def varlen_reference(q, k, v, cu_q, cu_k, scale=None, causal=True, left=-1):
    """Packed varlen attention, one SDPA per segment (CPU; and the check of the CUDA path)."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qe == qs:
            continue
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1)
        vi = v[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1)
        mask = None
        if causal:
            nq, nk = qe - qs, ke - ks
            qpos = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
            kpos = torch.arange(nk, device=q.device)[None, :]
            mask = kpos <= qpos
            if left >= 0:
                mask &= kpos >= qpos - left
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                    scale=scale).transpose(0, 1)
    return out


def check_torch_attention(device: str = "cuda", dtype: Any = None) -> float:
    """The CUDA path of ``TorchVarlenAttention`` against ``varlen_reference`` on a small tree
    (segments whose queries are the last of their keys, grouped-query heads), forward and
    backward; raises with the error if they disagree, else returns the largest output error.
    Run before training, so a kernel mismatch fails in seconds, not as a wrong loss."""
    import torch

    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 6, 9, 13]), torch.tensor([0, 6, 13, 23])
    q = torch.randn(13, 8, 64, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(23, 2, 64, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(23, 2, 64, generator=gen).to(device, dtype).requires_grad_()
    out = TorchVarlenAttention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 10,
                                                      softmax_scale=0.125, causal=True)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    qf, kf, vf = (t.detach().float().cpu().requires_grad_() for t in (q, k, v))
    ref = varlen_reference(qf, kf, vf, cu_q, cu_k, 0.125, True)
    ref_grads = torch.autograd.grad(ref.square().sum(), (qf, kf, vf))
    err = (out.float().cpu() - ref).abs().max().item()
    gerr = max((g.float().cpu() - r).abs().max().item() / (r.abs().max().item() + 1e-6)
               for g, r in zip(grads, ref_grads, strict=True))
    if err > 0.05 or gerr > 0.05:
        raise RuntimeError(f"--attention torch disagrees with the reference on {device}: output "
                           f"error {err:.3g}, relative gradient error {gerr:.3g}")
    return err


def use_torch_attention() -> None:
    """Point TRL's tree attention at ``TorchVarlenAttention`` instead of the Hub's FA3 kernel."""
    from trl.experimental.async_grpo import packing

    packing._flash_attn = lambda: TorchVarlenAttention


class NoWeightSync:
    """TRL's WeightTransferProtocol doing nothing (``--weight-sync none``)."""

    def init_weight_transfer(self) -> None: ...
    def pause(self) -> None: ...
    def send_weights(self, iterator: Any) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...


def no_mfu_without_cuda() -> None:
    """TRL reads the training GPU's name for its MFU peak unconditionally
    (``torch.cuda.get_device_name``), which raises on a CPU-only machine: no MFU there."""
    from trl.experimental.async_grpo import async_grpo_trainer

    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None


# ----------------------------------------------------------------------------- measurement


class Recorder:
    """Step-end wall clock and TRL's per-step log, keyed by global step."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.unix0 = time.time()
        self.train_begin: float | None = None
        self.step_end: dict[int, float] = {}
        self.logs: dict[int, dict[str, Any]] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0


def make_callback(rec: Recorder):
    from transformers import TrainerCallback

    class _Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            rec.train_begin = rec.now()

        def on_step_end(self, args, state, control, **kw):
            rec.step_end[state.global_step] = rec.now()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "train_runtime" not in logs:  # per-step logs, not the final summary
                rec.logs.setdefault(state.global_step, {}).update(logs)

    return _Marks()



def metrics_rows(step_end: dict[int, float], logs: dict[int, dict], *, train_begin: float,
                 unix0: float) -> list[dict[str, Any]]:
    """One metrics row per finished step in bench.gpu_bench's names (``ts``: unix time at the
    step's end; ``step_s``: our wall clock between step ends), plus TRL's own logged values
    renamed by ``TRL_KEYS``; MFU also as fractions (``mfu``, ``mfu_compute``). Pure."""
    rows, prev = [], train_begin
    for s in sorted(step_end):
        end = step_end[s]
        log = logs.get(s, {})
        row: dict[str, Any] = {"step": s, "ts": round(unix0 + end, 3),
                               "step_s": round(end - prev, 4)}
        for key, ours in TRL_KEYS.items():
            v = trl_runner.number(log.get(key))
            if v is not None:
                row[ours] = v
        if "mfu_wall_pct" in row:
            row["mfu"] = row["mfu_wall_pct"] / 100.0
        if "mfu_fwd_bwd_pct" in row:
            row["mfu_compute"] = row["mfu_fwd_bwd_pct"] / 100.0
        rows.append(row)
        prev = end
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Run totals from the rows (pure): medians of TRL's figures after the first step."""
    def median(key: str) -> float | None:
        vals = sorted(r[key] for r in rows[1:] if key in r)
        return vals[len(vals) // 2] if vals else None

    return {"steps_done": len(rows),
            "median_after_first_step": {k: median(k) for k in (
                "step_s", "trl_step_s", "trl_trained_tok_s", "mfu_wall_pct", "mfu_fwd_bwd_pct",
                "sync_s", "rollout_wait_s", "staleness_mean", "staleness_max", "train_s")},
            "dropped_stale": sum(r.get("dropped_stale", 0.0) for r in rows)}


# ----------------------------------------------------------------------------- run


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fill ``result`` (also on failure: what was measured until then)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # inherited by the rollout child
    rec = Recorder()
    out_dir = args.out.resolve().parent
    workdir = args.workdir or out_dir / f"{args.out.stem}.trl"
    result.update(framework="trl-async",
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    try:
        with trl_runner.serving(args, result, "trl-async", out_dir) as server_url:
            import torch
            from datasets import Dataset
            from transformers import AutoTokenizer
            from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

            cuda = torch.cuda.is_available()
            if not cuda:
                no_mfu_without_cuda()
            if args.attention == "torch":
                use_torch_attention()
                if cuda:
                    result["attention_check_max_err"] = check_torch_attention()
            if args.ignore_eos:
                install_ignore_eos()  # harmless here; the rollout child installs it on unpickling
            tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(args.model))
            rows = arithmetic_dataset_rows(args.num_prompts, args.max_operand, chat=True)
            cfg_kw = async_config_kwargs(args, cuda=cuda, output_dir=str(workdir),
                                         server_url=server_url)
            config = AsyncGRPOConfig(**cfg_kw)
            trainer = AsyncGRPOTrainer(model=str(args.model),
                                       reward_funcs=[ExactMatchReward(args.ignore_eos)],
                                       args=config,
                                       train_dataset=Dataset.from_list(rows),
                                       processing_class=tokenizer, callbacks=[make_callback(rec)],
                                       weight_transfer=(NoWeightSync() if args.weight_sync == "none"
                                                        else None))
            result["config"] = {k: v for k, v in cfg_kw.items() if k != "output_dir"}
            result["config"]["max_inflight_tasks"] = config.max_inflight_tasks
            result["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
            trainer.train()
    finally:
        rows_out = metrics_rows(rec.step_end, rec.logs, train_begin=rec.train_begin or 0.0,
                                unix0=rec.unix0)
        result["steps"] = rows_out
        result.update(summarize(rows_out))
        result["startup_s"] = rec.train_begin
        result["logs"] = {str(k): v for k, v in rec.logs.items()}
        result["total_wall_s"] = rec.now()
        result["versions"] = trl_runner.package_versions()


SUMMARY = ("[trl-async] {steps_done} steps; median s/step {median_after_first_step[step_s]}, "
           "MFU wall {median_after_first_step[mfu_wall_pct]} %, "
           "fwd+bwd {median_after_first_step[mfu_fwd_bwd_pct]} %")


def main(argv: list[str] | None = None) -> int:
    return trl_runner.run_main("trl_async", build_parser(), argv, validate_args, run, SUMMARY)


if __name__ == "__main__":  # TRL's rollout worker is spawned: it re-imports this module
    raise SystemExit(main())
