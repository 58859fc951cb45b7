"""Generation throughput: offline vLLM ``LLM.generate`` vs the producer's streaming path.

    python -m bench.producer [--model tiny|smollm2-135m|PATH] [--prompts 64]
                                      [--group-size 8] [--max-tokens 64]

In one run, on the same chat-templated prompts and the same engine arguments (built by
``pipeline.producer.engine.engine_kwargs``):
1. offline: ``LLM.generate`` with ``n=group_size``, ``ignore_eos``, ``max_tokens`` (FINAL_ONLY
   outputs, no logprobs; with ``--offline-logprobs`` also with the producer's sampled-token
   logprob, the share of the gap that any RL trainer using engine logprobs pays); the engine is
   then shut down;
2. producer: an AsyncLLM from ``pipeline.producer.engine.build_engine`` driven through
   ``GroupRollout._generate_one`` for each ``generation.stream`` mode (FINAL_ONLY or DELTA,
   ``logprobs=0``, per-token version tagging), G requests per prompt as
   ``GroupRollout.run`` issues them, no rewards, no ZMQ.
All requests are submitted at once in both (no admission budget), so the ratio measures the cost
of streaming + logprobs + tagging, not of admission. Each engine gets one untimed warm-up request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    from pipeline.config import DataConfig
    from pipeline.producer.data import render_prompt
    from pipeline.tasks.arithmetic import make_arithmetic_prompts

    cfg = DataConfig()
    return [render_prompt(tokenizer, cfg, r["prompt"])
            for r in make_arithmetic_prompts(n, seed=1234)]


def _sampling(args: argparse.Namespace, n: int, kind: Any = None, logprobs: bool = False,
              detokenize: bool = True) -> Any:
    """Every request of this benchmark: ``n`` completions of exactly ``--max-tokens`` tokens;
    ``logprobs``: the sampled token's logprob (flat), as the producer asks for it."""
    from vllm import SamplingParams

    extra = {} if kind is None else {"output_kind": kind}  # None: LLM.generate sets its own
    return SamplingParams(n=n, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0,
                          ignore_eos=True, logprobs=0 if logprobs else None,
                          flat_logprobs=logprobs, detokenize=detokenize, **extra)


def _producer_sampling(args: argparse.Namespace, stream: str) -> Any:
    """Exactly the parameters of GroupRollout.run (one request per completion)."""
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if stream == "final" else RequestOutputKind.DELTA
    return _sampling(args, 1, kind, logprobs=True, detokenize=False)


def _wait_children(timeout: float = 30.0) -> None:
    """Wait for the previous engine's processes to exit, so the two runs never overlap."""
    import psutil

    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                procs.append(p)
        except psutil.Error:  # already gone, or a zombie about to be reaped
            continue
    psutil.wait_procs(procs, timeout=timeout)


def bench_offline(args, model_path: Path, kw: dict, prompts: list[list[int]]
                  ) -> dict[str, tuple[int, float]]:
    """``LLM.generate`` as users run it offline (no logprobs), and, with ``--offline-logprobs``,
    again with the sampled-token logprob the producer needs: {label: (tokens, seconds)}."""
    from vllm import LLM

    llm = LLM(**kw)
    out: dict[str, tuple[int, float]] = {}
    try:
        for label, logprobs in (("offline", False), ("offline+logprobs", True))[
                :2 if args.offline_logprobs else 1]:
            sp = _sampling(args, args.group_size, logprobs=logprobs)
            llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            out[label] = (sum(len(c.token_ids) for o in outs for c in o.outputs), dt)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        _wait_children()
    return out


def bench_producer(args, cfg: Any, model_path: Path, tokenizer: Any,
                   prompts: list[list[int]]) -> dict[str, tuple[int, float]]:
    """Producer path per streaming mode (generation.stream), on one engine: {mode: (tokens, s)}."""
    import dataclasses

    from pipeline.producer.engine import build_engine
    from pipeline.producer.loop import Producer

    async def run() -> dict[str, tuple[int, float]]:
        engine = build_engine(cfg.model, cfg.engine, str(model_path), cfg.engine.seed)
        out: dict[str, tuple[int, float]] = {}
        try:
            if args.ablation:
                await _async_ablations(args, engine, prompts)
            for mode in args.streams.split(","):
                gen = dataclasses.replace(cfg.generation, stream=mode)
                mcfg = dataclasses.replace(cfg, generation=gen)
                # No endpoint, rewards or prompt source: only the generation path is exercised.
                producer = Producer(mcfg, 0, engine, tokenizer, None, None, None)
                sp = _producer_sampling(args, mode)
                await producer.rollout._generate_one(f"warmup-{mode}", prompts[0], sp)
                t0 = time.perf_counter()
                results = await asyncio.gather(*(
                    producer.rollout._generate_one(f"{mode}{i}-{j}", p, sp)
                    for i, p in enumerate(prompts) for j in range(args.group_size)))
                dt = time.perf_counter() - t0
                tokens = 0
                for comp, _text in results:
                    assert len(comp.logprobs) == len(comp.token_ids)
                    assert [tuple(s) for s in comp.version_segments] == [(0, 0)]
                    tokens += len(comp.token_ids)
                out[mode] = (tokens, dt)
            return out
        finally:
            engine.shutdown()

    out = asyncio.run(run())
    _wait_children()
    return out


async def _async_ablations(args, engine: Any, prompts: list[list[int]]) -> None:
    """Ablations on the producer's engine, to split the gap to offline into its causes. Each
    times the same completions through AsyncLLM with one thing changed towards the producer:
    (a) the offline request shape (n=G, FINAL_ONLY, no logprobs, detokenised);
    (b) G requests of n=1 with DELTA streaming (the producer's old shape);
    (c) G requests of n=1, FINAL_ONLY, no detokenisation, no logprobs;
    (d) as (c) with flat sampled-token logprobs (the producer's request, minus our Python);
    (e) n=G, FINAL_ONLY, no detokenisation, flat logprobs (one request per group)."""
    from vllm.sampling_params import RequestOutputKind

    def sp(n: int, kind: Any, logprobs: bool, detok: bool) -> Any:
        return _sampling(args, n, kind, logprobs=logprobs, detokenize=detok)

    final, delta, g = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA, args.group_size
    cases = [("(a) n=G   FINAL_ONLY detok, no logprobs", sp(g, final, False, True), g),
             ("(b) G x n=1 DELTA detok, no logprobs   ", sp(1, delta, False, True), 1),
             ("(c) G x n=1 FINAL_ONLY, no logprobs    ", sp(1, final, False, False), 1),
             ("(d) G x n=1 FINAL_ONLY, flat logprobs  ", sp(1, final, True, False), 1),
             ("(e) n=G   FINAL_ONLY, flat logprobs    ", sp(g, final, True, False), g)]

    async def one(rid: str, p: list[int], s: Any) -> int:
        n = 0
        async for out in engine.generate({"prompt_token_ids": p}, s, rid):
            if s.output_kind == delta or out.finished:
                n += sum(len(c.token_ids) for c in out.outputs)
        return n

    for label, s, n in cases:
        await one(f"warm{label[1]}", prompts[0], s)  # untimed: first use of logprobs compiles
        reqs = [(f"{label[1]}{i}-{j}", p) for i, p in enumerate(prompts)
                for j in range(args.group_size // n)]
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(rid, p, s) for rid, p in reqs)))
        dt = time.perf_counter() - t0
        print(f"[bench_producer] ablation {label}: {tokens} tokens in {dt:.2f} s = "
              f"{tokens / dt:.0f} tok/s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.producer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m | a local HF directory")
    p.add_argument("--cache-dir", default=".cache/models", help="where tiny/smollm2 are built")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine.max_num_seqs for both engines (default: vLLM's)")
    p.add_argument("--streams", default="final,delta",
                   help="producer streaming modes to time (generation.stream), comma-separated")
    p.add_argument("--offline-logprobs", action="store_true",
                   help="also time offline LLM.generate with the sampled-token logprob the "
                        "producer asks for (flat_logprobs), as a second reference")
    p.add_argument("--ablation", action="store_true",
                   help="also time, on the producer's engine, AsyncLLM request shapes between the "
                        "offline one and the producer's (see _async_ablations)")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.producer.engine import engine_kwargs

    model_path = resolve_model(args.model, Path(args.cache_dir))
    cfg = load_config(None, {
        "run_dir": tempfile.mkdtemp(prefix="bench-producer-"),  # the producer's outbox goes here
        "model.path": str(model_path), "model.dtype": args.dtype,
        "engine.max_num_seqs": args.max_num_seqs,
        "engine.max_model_len": 512 if args.max_tokens < 400 else args.max_tokens + 256,
        "generation.group_size": args.group_size, "generation.max_tokens": args.max_tokens,
        "generation.ignore_eos": True})
    # Same variable build_engine sets for the CPU backend; the offline LLM needs it too.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.engine.cpu_kvcache_space_gib))
    import vllm
    from vllm.platforms import current_platform

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = _prompts(tokenizer, args.prompts)
    kw = engine_kwargs(cfg.model, cfg.engine, str(model_path), cfg.engine.seed, current_platform)

    n_req = args.prompts * args.group_size
    print(f"[bench_producer] vLLM {vllm.__version__}, model {model_path}, {args.prompts} "
          f"prompts x G={args.group_size}, max_tokens={args.max_tokens} (ignore_eos), "
          f"{n_req} completions", flush=True)
    offline = bench_offline(args, model_path, kw, prompts)
    for label, (tok, sec) in offline.items():
        print(f"[bench_producer] {label} LLM.generate : {tok} tokens in {sec:.2f} s = "
              f"{tok / sec:.0f} tok/s", flush=True)
    for mode, (pr_tok, pr_s) in bench_producer(args, cfg, model_path, tokenizer,
                                               prompts).items():
        pr_tps = pr_tok / pr_s
        ratios = "; ".join(f"ratio producer/{label} = {pr_tps / (tok / sec):.2f}"
                           for label, (tok, sec) in offline.items())
        print(f"[bench_producer] producer, stream={mode} (AsyncLLM + logprobs + version tags): "
              f"{pr_tok} tokens in {pr_s:.2f} s = {pr_tps:.0f} tok/s; {ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
