"""Multi-turn episode throughput against single-turn generation of the same tokens.

    python -m bench.agentic_bench [--model tiny|smollm2-135m|PATH] [--prompts 16]
                                  [--group-size 4] [--turns 3] [--tokens-per-turn 32]

On one engine (``pipeline.producer.engine.build_engine``), through the producer's own paths
(``GroupRollout._generate_one`` and ``GroupRollout._run_episodes``; no learner, rewards or
ZeroMQ):
1. single-turn: G requests per prompt of ``turns x tokens-per-turn`` tokens each (ignore_eos);
2. episodes: G episodes per prompt of ``turns`` turns of ``tokens-per-turn`` tokens (ignore_eos),
   a tool call (a sync function, run as ``ctx.tool`` runs it) appending a short environment
   text between turns.
Both generate the same number of policy tokens; the episode path pays for the extra requests,
the re-prefill of the growing transcript (served from the prefix cache within one version) and
the tools. Reported: generated tokens/s of each, their ratio, and the prefix-cache hit rate of
the episodes' later turns (cached prompt tokens / prompt tokens, from vLLM's
``RequestOutput.num_cached_tokens``; the cache reuses whole KV blocks, 128 tokens on vLLM's
CPU backend by default, so short turns hit little there unless ``--block-size`` is smaller, a
multiple of 32 on CPU).
All requests start at once; one untimed warm-up each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

ENV_TEXT = "\nresult: 42\n"


def _tool() -> str:
    return ENV_TEXT


async def bench_episode(
    ctx: Any, prompt: Any, turns: int = 3, per_turn: int = 32, **meta: Any
) -> float:
    """``turns`` turns of exactly ``per_turn`` tokens, a tool's answer between them."""
    for t in range(turns):
        if t:
            ctx.append(await ctx.tool(_tool))
        await ctx.generate(max_tokens=per_turn, ignore_eos=True)
    return 0.0


class CacheProbe:
    """Wraps an engine's ``generate`` to read each finished request's cached prompt tokens."""

    def __init__(self, engine: Any):
        self.engine, self._generate = engine, engine.generate
        self.rows: list[tuple[str, int, int]] = []  # (request id, prompt tokens, cached)
        engine.generate = self.generate

    async def generate(self, prompt: Any, sp: Any, request_id: str, **kw: Any):
        async for out in self._generate(prompt, sp, request_id, **kw):
            if out.finished:
                self.rows.append(
                    (
                        request_id,
                        len(prompt["prompt_token_ids"]),
                        int(getattr(out, "num_cached_tokens", 0) or 0),
                    )
                )
            yield out

    def hit_rate(self, later_turns_only: bool = True) -> tuple[int, int]:
        rows = [r for r in self.rows if not later_turns_only or not r[0].endswith("-t0-a0")]
        return sum(r[2] for r in rows), sum(r[1] for r in rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.producer.data import PromptRecord, render_prompt
    from pipeline.producer.engine import build_engine
    from pipeline.producer.loop import Producer
    from pipeline.tasks.arithmetic import make_arithmetic_prompts

    total = args.turns * args.tokens_per_turn
    model_path = resolve_model(args.model, Path(args.cache_dir))
    cfg = load_config(
        None,
        {
            "run_dir": tempfile.mkdtemp(prefix="bench-agentic-"),
            "model.path": str(model_path),
            "engine.max_model_len": 1024,
            "generation.group_size": args.group_size,
            "generation.max_tokens": total,
            "engine.extra": {"block_size": args.block_size} if args.block_size else {},
            "episode.max_turns": args.turns,
            "episode.max_tokens": total + 64 * args.turns,
        },
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records = [
        PromptRecord(r["prompt_id"], r["prompt"], {}, i)
        for i, r in enumerate(make_arithmetic_prompts(args.prompts, seed=1234))
    ]
    prompts = [render_prompt(tokenizer, cfg.data, r.prompt) for r in records]

    async def main() -> dict[str, Any]:
        engine = build_engine(cfg.model, cfg.engine, str(model_path), cfg.engine.seed)
        try:
            probe = CacheProbe(engine)
            producer = Producer(cfg, 0, engine, tokenizer, None, None, None)
            rollout = producer.rollout
            rollout.episode_fn = bench_episode
            single = rollout._sampling(max_tokens=total, ignore_eos=True)
            meta = {"turns": args.turns, "per_turn": args.tokens_per_turn}
            await rollout._generate_one("warm-single", prompts[0], single)
            await rollout._run_episodes("warm-ep", records[0], prompts[0], dict(meta))
            t0 = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    rollout._generate_one(f"s{i}-{j}", p, single)
                    for i, p in enumerate(prompts)
                    for j in range(args.group_size)
                )
            )
            single_s = time.perf_counter() - t0
            single_tokens = sum(len(c.token_ids) for c, _ in outs)
            probe.rows.clear()
            t0 = time.perf_counter()
            groups = await asyncio.gather(
                *(
                    rollout._run_episodes(f"e{i}", r, p, dict(meta))
                    for i, (r, p) in enumerate(zip(records, prompts, strict=True))
                )
            )
            ep_s = time.perf_counter() - t0
            comps = [e.completion for g in groups for e in g]
            ep_tokens = sum(int(c.loss_mask().sum()) for c in comps)
            env_tokens = sum(len(c.token_ids) for c in comps) - ep_tokens
            failures = sum(1 for g in groups for e in g if e.failure)
            cached, prompt_tokens = probe.hit_rate()
            return {
                "single_tokens": single_tokens,
                "single_s": single_s,
                "episode_tokens": ep_tokens,
                "episode_env_tokens": env_tokens,
                "episode_s": ep_s,
                "episodes": len(comps),
                "failures": failures,
                "cached": cached,
                "prompt_tokens": prompt_tokens,
            }
        finally:
            engine.shutdown()

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.agentic_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m | a local HF directory")
    p.add_argument("--cache-dir", default=".cache/models", help="where tiny/smollm2 are built")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens-per-turn", type=int, default=32)
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="KV cache block size (engine.extra; 0: vLLM's default, 128 on CPU). The "
        "prefix cache reuses whole blocks only: later turns hit the part of the "
        "transcript that fills complete blocks",
    )
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    r = run(args)
    s_tps = r["single_tokens"] / r["single_s"]
    e_tps = r["episode_tokens"] / r["episode_s"]
    print(
        f"[agentic_bench] {args.prompts} prompts x G={args.group_size}, {args.turns} turns x "
        f"{args.tokens_per_turn} tokens, model {args.model}"
    )
    print(
        f"[agentic_bench] single-turn: {r['single_tokens']} tokens in {r['single_s']:.2f} s = "
        f"{s_tps:.0f} tok/s"
    )
    print(
        f"[agentic_bench] episodes   : {r['episode_tokens']} generated (+{r['episode_env_tokens']}"
        f" tool) tokens in {r['episode_s']:.2f} s = {e_tps:.0f} tok/s, {r['failures']} of "
        f"{r['episodes']} failed"
    )
    print(
        f"[agentic_bench] ratio episodes/single-turn = {e_tps / s_tps:.2f}; prefix-cache hits "
        f"of turns 2+: {r['cached']}/{r['prompt_tokens']} prompt tokens = "
        f"{r['cached'] / max(r['prompt_tokens'], 1):.1%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
