"""Evaluation on held-out prompts: which versions to evaluate, generating and scoring them, and
the figures the learner logs (``eval/reward_mean``, ``eval/pass@k``, ``eval/<reward>``).

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

from pipeline.config import ConfigError, DataConfig, EvalConfig
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


def last_version(steps: int, sync_every: int) -> int:
    """The last weights version a run publishes: one per ``sync_every`` steps, none after the
    final step (a step whose update was skipped as non-finite publishes nothing: then fewer)."""
    return max(steps - 1, 0) // sync_every


def is_due(version: int, every: int, last: int) -> bool:
    """Whether ``version`` is evaluated: every ``every``-th one (0 included: the base model),
    and always the last; never when evaluation is off (``every`` 0)."""
    return every > 0 and (version % every == 0 or version == last)


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
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    t0 = time.perf_counter()
    sp = SamplingParams(
        n=ev.samples_per_prompt,
        max_tokens=max_tokens,
        temperature=ev.temperature,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    if episodes is not None:
        return await _evaluate_episodes(engine, tokenizer, data, ev, max_model_len, records,
                                        rewards, version, lora_request, episodes, t0)

    async def one(i: int, rec: PromptRecord) -> tuple[Any, list[list[int]], list[str]] | None:
        ids = render_prompt(tokenizer, data, rec.prompt)
        if len(ids) > data.max_prompt_tokens or len(ids) + 1 >= max_model_len:
            return None  # as in training: too long for the engine
        final = None
        prompt = {"prompt_token_ids": ids, "cache_salt": f"v{version}"}
        async for out in engine.generate(prompt, sp, f"eval-v{version}-{i}-{time.time_ns()}",
                                         lora_request=lora_request):
            final = out
        outs = final.outputs if final is not None else []
        return rec, [list(c.token_ids) for c in outs], [c.text for c in outs]

    generated = await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))
    totals, breakdowns, dropped, skipped, tokens = [], [], 0, 0, 0
    for item in generated:
        if item is None:
            skipped += 1
            continue
        rec, ids, texts = item
        tokens += sum(len(x) for x in ids)
        meta = dict(rec.meta, prompt_id=rec.prompt_id)
        result = await rewards.score_group(rec.prompt, texts, meta, completion_ids=ids)
        if result.dropped:
            dropped += 1
            continue
        totals.append(result.total)
        breakdowns.append(result.breakdown)
    return _figures(totals, breakdowns, ev, dropped, skipped, tokens, t0)


def _figures(totals: list, breakdowns: list, ev: EvalConfig, dropped: int, skipped: int,
             tokens: int, t0: float) -> dict[str, float]:
    out = aggregate(totals, breakdowns, ev.samples_per_prompt, ev.pass_threshold)
    out.update(
        {
            "eval/prompts_dropped": float(dropped),
            "eval/prompts_skipped": float(skipped),
            "eval/tokens": float(tokens),
            "eval/seconds": time.perf_counter() - t0,
        }
    )
    return out


@dataclass(frozen=True)
class EpisodeRun:
    """What evaluating with episodes needs of the run: the episode function, its config
    (``EpisodeConfig``) and ``rewards.on_failure``."""

    fn: Callable[..., Awaitable[Any]]
    cfg: Any
    on_failure: str


async def _evaluate_episodes(
    engine: Any,
    tokenizer: Any,
    data: DataConfig,
    ev: EvalConfig,
    max_model_len: int,
    records: Sequence[PromptRecord],
    rewards: Any,
    version: int,
    lora_request: Any,
    episodes: EpisodeRun,
    t0: float,
) -> dict[str, float]:
    """``generate_and_score`` with each sample an episode. Turns go to the engine directly (no
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

    async def one(i: int, rec: PromptRecord) -> tuple[list, list, int] | str:
        ids = render_prompt(tokenizer, data, rec.prompt)
        if len(ids) > data.max_prompt_tokens or len(ids) + 1 >= max_model_len:
            return "skipped"
        meta = dict(rec.meta, prompt_id=rec.prompt_id)
        results = await run_episodes(
            episodes.fn, ev.samples_per_prompt, generate=generate, tokenizer=tokenizer,
            prompt_ids=ids, limits=episode_limits(episodes.cfg), max_model_len=max_model_len,
            request_prefix=f"eval-v{version}-{i}-{time.time_ns()}", version=lambda: version,
            prompt=rec.prompt, prompt_id=rec.prompt_id, kwargs={**episodes.cfg.kwargs, **meta})
        if any(r.failure for r in results) and episodes.on_failure == "drop":
            return "dropped"
        scored = await score_episodes(rewards, rec.prompt, results, meta)
        if scored is None:
            return "dropped"
        return scored[0], scored[1], sum(len(r.completion.token_ids) for r in results)

    done = await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))
    kept = [d for d in done if not isinstance(d, str)]
    return _figures([d[0] for d in kept], [d[1] for d in kept], ev, done.count("dropped"),
                    done.count("skipped"), sum(d[2] for d in kept), t0)
