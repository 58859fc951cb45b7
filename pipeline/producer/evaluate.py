"""Evaluation on held-out prompts: generating and scoring them, and the figures the learner logs
(``eval/reward_mean``, ``eval/pass@k``, ``eval/<reward>``); which versions are evaluated is
``pipeline.schedule``.

Invariants: evaluation completions are never rollout groups. They are generated here, scored
by the run's rewards, reduced to a few numbers, and only those numbers leave the producer (an
``EvalResult`` control message, ``buffer.protocol``); nothing here touches the data channel,
the producer's group counters or the dataset cursor. Every completion of one evaluation runs on
one weights version: the producer runs it while no swap can start (``Producer._apply_announce``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config import DataConfig, EvalConfig
from pipeline.options import ConfigError
from pipeline.producer.data import PromptRecord, PromptSource, load_records, render_prompt


def eval_data_config(data: DataConfig, ev: EvalConfig) -> DataConfig:
    """The training data's options (prompt/answer/id fields, chat template, system prompt) on the
    held-out file, read in file order."""
    return dataclasses.replace(data, path=ev.data, seed=-1)


def _as_eval_error(e: ConfigError) -> ConfigError:
    text = str(e)
    return ConfigError(
        "eval.data" + text[len("data.path") :] if text.startswith("data.path") else text
    )


def eval_records(data: DataConfig, ev: EvalConfig) -> list[PromptRecord]:
    """The held-out prompts (the first ``max_prompts`` in file order). ConfigError naming
    ``eval.data`` when the file cannot be read or its records lack the data fields."""
    cfg = eval_data_config(data, ev)
    try:
        recs = load_records(cfg.path)
        if not recs:
            raise ConfigError(f"eval.data: {cfg.path} holds no records")
        source = PromptSource(cfg, 0, 1, records=recs)
    except ConfigError as e:
        raise _as_eval_error(e) from None
    n = len(recs) if not ev.max_prompts else min(ev.max_prompts, len(recs))
    return [next(source) for _ in range(n)]


def pass_at_k(passed: Sequence[Sequence[bool]]) -> float:
    """Fraction of prompts with at least one passing completion among their k samples (with
    n = k samples per prompt, the unbiased pass@k estimator reduces to this)."""
    if not passed:
        return 0.0
    return sum(1.0 for p in passed if any(p)) / len(passed)


def aggregate(
    totals: Sequence[Sequence[float]],
    breakdowns: Sequence[Sequence[Mapping[str, float]]],
    k: int,
    threshold: float,
) -> dict[str, float]:
    """The figures of one evaluation from each prompt's completions' total rewards and
    per-reward breakdowns: ``eval/reward_mean`` (over completions), ``eval/pass@k``,
    ``eval/<reward>`` (each reward's mean over the completions it scored), ``eval/prompts``."""
    flat = [t for ts in totals for t in ts]
    out = {
        "eval/reward_mean": sum(flat) / len(flat) if flat else 0.0,
        f"eval/pass@{k}": pass_at_k([[t >= threshold for t in ts] for ts in totals]),
        "eval/prompts": float(len(totals)),
    }
    per: dict[str, list[float]] = {}
    for bs in breakdowns:
        for b in bs:
            for name, v in b.items():
                per.setdefault(name, []).append(float(v))
    for name in sorted(per):
        key = f"eval/{name}"
        if key not in out:  # a reward named like a summary figure keeps the summary's name
            out[key] = sum(per[name]) / len(per[name])
    return out


async def generate_and_score(
    engine: Any,
    tokenizer: Any,
    data: DataConfig,
    ev: EvalConfig,
    max_tokens: int,
    max_model_len: int,
    records: Sequence[PromptRecord],
    rewards: Any,
    version: int,
    lora_request: Any = None,
    episodes: EpisodeRun | None = None,
) -> dict[str, float]:
    """Run every held-out prompt ``samples_per_prompt`` times on the engine's current weights
    (tagged ``version``), score with ``rewards`` (a ``RewardSet``) and aggregate. Prompts the
    rewards drop (``on_failure: drop``) are left out and counted in ``eval/prompts_dropped``,
    prompts too long for the engine in ``eval/prompts_skipped``. ``lora_request``: the
    version's LoRA adapter under adapter-only sync (``pipeline.producer.adapters``).
    ``episodes``: each sample is an episode of the run's ``episode.fn``, scored as in training
    (a failed one 0, or its prompt dropped under ``on_failure: drop``)."""
    t0 = time.perf_counter()
    sample = (
        _episode_sampler(engine, tokenizer, ev, max_model_len, rewards, version, lora_request,
                         episodes)
        if episodes is not None
        else _sampler(engine, ev, max_tokens, rewards, version, lora_request)
    )

    async def one(i: int, rec: PromptRecord) -> Scored | str:
        ids = render_prompt(tokenizer, data, rec.prompt)
        if len(ids) > data.max_prompt_tokens or len(ids) + 1 >= max_model_len:
            return "skipped"  # as in training: too long for the engine
        meta = dict(rec.meta, prompt_id=rec.prompt_id)
        scored = await sample(f"eval-v{version}-{i}-{time.time_ns()}", rec, ids, meta)
        return "dropped" if scored is None else scored

    done = await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))
    kept = [d for d in done if not isinstance(d, str)]
    out = aggregate([d[0] for d in kept], [d[1] for d in kept], ev.samples_per_prompt,
                    ev.pass_threshold)
    out.update(
        {
            "eval/prompts_dropped": float(done.count("dropped")),
            "eval/prompts_skipped": float(done.count("skipped")),
            "eval/tokens": float(sum(d[2] for d in kept)),
            "eval/seconds": time.perf_counter() - t0,
        }
    )
    return out


Scored = tuple[Sequence[float], Sequence[Mapping[str, float]], int]
"""One held-out prompt's samples: their total rewards, breakdowns, and generated tokens."""
Sampler = Callable[[str, PromptRecord, list[int], dict[str, Any]], Awaitable[Scored | None]]
"""(request id, record, prompt token ids, meta) -> the prompt's Scored, None if dropped."""


def _sampler(engine: Any, ev: EvalConfig, max_tokens: int, rewards: Any, version: int,
             lora_request: Any) -> Sampler:
    """Single-turn: one request for the prompt's ``samples_per_prompt`` completions."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(
        n=ev.samples_per_prompt,
        max_tokens=max_tokens,
        temperature=ev.temperature,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def sample(rid: str, rec: PromptRecord, ids: list[int], meta: dict[str, Any]
                     ) -> Scored | None:
        final = None
        prompt = {"prompt_token_ids": ids, "cache_salt": f"v{version}"}
        async for out in engine.generate(prompt, sp, rid, lora_request=lora_request):
            final = out
        outs = final.outputs if final is not None else []
        token_ids = [list(c.token_ids) for c in outs]
        result = await rewards.score_group(rec.prompt, [c.text for c in outs], meta,
                                           completion_ids=token_ids)
        if result.dropped:
            return None
        return result.total, result.breakdown, sum(len(x) for x in token_ids)

    return sample


@dataclass(frozen=True)
class EpisodeRun:
    """What evaluating with episodes needs of the run: the episode function, its config
    (``EpisodeConfig``) and ``rewards.on_failure``."""

    fn: Callable[..., Awaitable[Any]]
    cfg: Any
    on_failure: str


def _episode_sampler(engine: Any, tokenizer: Any, ev: EvalConfig, max_model_len: int,
                     rewards: Any, version: int, lora_request: Any,
                     episodes: EpisodeRun) -> Sampler:
    """Each sample an episode, scored as in training. Turns go to the engine directly (no
    admission gate: no swap starts during an evaluation) at the evaluation's temperature."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from buffer.schema import Completion
    from pipeline.producer.episode import episode_limits, run_episodes, score_episodes

    async def generate(rid: str, ids: list[int], overrides: dict[str, Any]
                       ) -> tuple[Completion, str]:
        sp = SamplingParams(**{"temperature": ev.temperature, **overrides, "n": 1,
                               "output_kind": RequestOutputKind.FINAL_ONLY})
        final = None
        async for out in engine.generate({"prompt_token_ids": ids, "cache_salt": f"v{version}"},
                                         sp, rid, lora_request=lora_request):
            final = out
        c = final.outputs[0]
        comp = Completion(token_ids=np.asarray(c.token_ids, np.int32),
                          logprobs=np.zeros(len(c.token_ids), np.float32),
                          version_segments=[(0, version)], finish_reason=c.finish_reason or "")
        return comp, c.text

    async def sample(rid: str, rec: PromptRecord, ids: list[int], meta: dict[str, Any]
                     ) -> Scored | None:
        results = await run_episodes(
            episodes.fn, ev.samples_per_prompt, generate=generate, tokenizer=tokenizer,
            prompt_ids=ids, limits=episode_limits(episodes.cfg), max_model_len=max_model_len,
            request_prefix=rid, version=lambda: version, prompt=rec.prompt,
            prompt_id=rec.prompt_id, kwargs={**episodes.cfg.kwargs, **meta})
        if any(r.failure for r in results) and episodes.on_failure == "drop":
            return None
        scored = await score_episodes(rewards, rec.prompt, results, meta)
        if scored is None:
            return None
        return scored[0], scored[1], sum(len(r.completion.token_ids) for r in results)

    return sample
