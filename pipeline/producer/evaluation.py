"""Evaluation on held-out prompts, the producer role's: generating and scoring them, the figures
the learner logs (``eval/reward_mean``, ``eval/pass@k``, ``eval/<reward>``), and the dedicated
evaluator process. Which versions are evaluated is ``pipeline.schedule``; the learner's side is
``pipeline.learner.evaluation``, ``pipeline-train eval`` of checkpoints
``pipeline.launch.evaluation``.

``generate_and_score`` is the one evaluation, run by the first producer on each due version
(shared evaluation, ``pipeline.producer.loop``), by the dedicated evaluator and by
``pipeline-train eval``. Invariants: evaluation completions are never rollout groups. They are
generated here, scored by the run's rewards, reduced to a few numbers, and only those numbers
leave the producer (an ``EvalResult`` control message, ``buffer.protocol``); nothing here touches
the data channel, the producer's group counters or the dataset cursor. Every completion of one
evaluation runs on one weights version: the producer runs it while no swap can start
(``Producer._apply_announce``), the evaluator loads a version and then evaluates it in one
coroutine.

The dedicated evaluator (``eval.producer: dedicated``, ``Evaluator``): an evaluation-only process
with its own vLLM engine that evaluates each due weights version as the learner announces it,
so that no producer ever pauses its rollouts for evaluation. It speaks the producers' control
protocol under its own id (``pipeline.schedule.EVALUATOR_ID``): Hello, Heartbeat (its counters)
and EvalResult (the figures, tagged with the version they measure). It sends no group, no Ack
and no SyncReady: the learner never waits for it, and it has no admission share and no data
shard. Weights come from each version's snapshot file (streamed to its node first with
``sync.stream_from``), or as a LoRA adapter under adapter-only sync
(``pipeline.producer.weights``). Which versions: once an evaluation is done, the newest announced
version, if it is due and not evaluated yet. A due version announced and superseded while the
evaluator was busy is skipped and counted (``versions_skipped``): its file may be gone by then,
and an evaluator that queued every version would fall ever further behind a learner that
publishes faster than it evaluates. The run's last version is the newest one at the end, so it
is always evaluated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from buffer.protocol import Announce, EvalResult, Heartbeat, Hello
from buffer.transport import ProducerEndpoint
from pipeline.config import DataConfig, EvalConfig, RunConfig
from pipeline.options import ConfigError
from pipeline.producer.data import PromptRecord, PromptSource, load_records, render_prompt
from pipeline.producer.episode import load_episode
from pipeline.producer.process import engine_process
from pipeline.producer.rewards.runner import RewardSet
from pipeline.producer.session import LearnerFinished, LearnerSession, run_tasks
from pipeline.producer.weights import EngineWeights, weight_routes
from pipeline.schedule import EVALUATOR_ID, is_due, last_version, skipped
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0


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
    version's LoRA adapter under adapter-only sync (``EngineWeights.lora_request``).
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


class Evaluator:
    """The dedicated evaluator (the module docstring)."""

    def __init__(self, cfg: RunConfig, engine: Any, tokenizer: Any, endpoint: ProducerEndpoint,
                 rewards: RewardSet, stop_when_learner_done: bool = False):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.endpoint, self.rewards = endpoint, rewards
        self.stop_when_learner_done = stop_when_learner_done
        self.producer_id = EVALUATOR_ID
        self.incarnation = f"{EVALUATOR_ID}-{os.getpid()}-{time.time_ns() % 10**12}"
        self.session = LearnerSession(
            endpoint, lambda: Hello(producer_id=self.producer_id, incarnation=self.incarnation,
                                    policy_version=self.weights.version, pid=os.getpid()),
            "the learner refused the evaluator: it runs without one (eval.producer differs "
            "between the roles?)")
        self.records = eval_records(cfg.data, cfg.eval)
        self.last = last_version(cfg.train.steps, cfg.sync.sync_every)
        # Snapshot files only: the learner sends the evaluator no GPU copy.
        self.weights = EngineWeights(engine, cfg, self.producer_id,
                                     weight_routes(engine, cfg, self.producer_id))
        fn = load_episode(cfg.episode.fn) if cfg.episode.fn else None
        self.episodes = EpisodeRun(fn, cfg.episode, cfg.rewards.on_failure) if fn else None
        self.base = True  # the engine holds the model's own weights (version 0)
        # The learner session whose snapshot the engine runs: a restarted learner trains its
        # versions anew, so a number the engine holds is the same weights in that session only.
        self.loaded_session = ""
        self.evaluated: set[int] = set()
        self.previous = -1  # the version evaluated last
        self.latest: Announce | None = None
        self._announced = asyncio.Event()
        self.stats = {"evaluations": 0.0, "versions_skipped": 0.0, "eval_s": 0.0, "swaps": 0.0,
                      "swap_failures": 0.0}

    # ------------------------------------------------------------------ versions
    async def _listen(self) -> None:
        while True:
            ann = await self.endpoint.recv_announce(timeout=1.0)
            if ann is None:
                continue
            if ann.finished and self.stop_when_learner_done:
                raise LearnerFinished(f"learner session {ann.learner_session} trained its "
                                      f"last step (version {ann.version})")
            if self.latest is not None and ann.learner_session != self.latest.learner_session:
                # A restarted learner trains from its checkpoint again: the versions it
                # publishes anew are new weights, whatever their numbers.
                self.evaluated.clear()
                self.previous = -1
            self.latest = ann
            self._announced.set()

    async def _evaluate_versions(self) -> None:
        while True:
            await self._announced.wait()
            self._announced.clear()
            ann = self.latest
            assert ann is not None
            v = ann.version
            if v in self.evaluated or not is_due(v, self.cfg.eval.every, self.last):
                continue
            self.stats["versions_skipped"] += skipped(self.previous, v, self.cfg.eval.every,
                                                      self.last)
            self.previous = max(self.previous, v)
            if await self._load(ann):
                await self._evaluate(v)

    async def _load(self, ann: Announce) -> bool:
        """Make the engine run ``ann.version``; False (logged, counted) when it cannot."""
        if not ann.snapshot_uri:  # the learner's base weights: nothing to load
            if not self.base:
                log.warning("%s: v%d has no snapshot file and the engine holds v%d; not "
                            "evaluated", self.producer_id, ann.version, self.weights.version)
            return self.base
        if not self.base and self.weights.version == ann.version and \
                self.loaded_session == ann.learner_session:
            return True
        report = await self.weights.load(
            SnapshotRef(ann.version, ann.snapshot_uri, ann.snapshot_checksum))
        assert report is not None  # its file is written: the announce names it
        self.stats["swaps" if report.ok else "swap_failures"] += 1
        if not report.ok:
            log.warning("%s: v%d not loaded, so not evaluated: %s", self.producer_id,
                        ann.version, report.error)
            return False
        self.base = False
        self.loaded_session = ann.learner_session
        return True

    async def _evaluate(self, v: int) -> None:
        """Evaluate the loaded version ``v`` and send its figures."""
        self.evaluated.add(v)
        stats = await generate_and_score(
            self.engine, self.tokenizer, self.cfg.data, self.cfg.eval,
            self.cfg.generation.max_tokens, self.cfg.engine.max_model_len, self.records,
            self.rewards, v, lora_request=self.weights.lora_request(v), episodes=self.episodes)
        latest = self.latest.version if self.latest is not None else v
        stats["eval/versions_behind"] = float(max(latest - v, 0))
        self.stats["evaluations"] += 1
        self.stats["eval_s"] += stats["eval/seconds"]
        log.info("%s: eval v%d: %s", self.producer_id, v,
                 ", ".join(f"{k.removeprefix('eval/')} {x:.3g}" for k, x in stats.items()))
        answer = await self.session.call(EvalResult(producer_id=self.producer_id,
                                                    incarnation=self.incarnation, version=v,
                                                    stats=stats))
        if answer is None or not answer.ok:
            log.warning("%s: the learner did not take the evaluation of v%d: %s",
                        self.producer_id, v, answer.reason if answer else "no answer")

    # ------------------------------------------------------------------ control
    async def _heartbeat(self) -> None:
        while True:
            await self.session.call(Heartbeat(producer_id=self.producer_id,
                                              incarnation=self.incarnation,
                                              policy_version=self.weights.version,
                                              stats=dict(self.stats)))
            await asyncio.sleep(HEARTBEAT_S)

    async def run(self) -> None:
        await self.weights.start()
        log.info("%s: engine ready; %d held-out prompts; waiting for the learner's announces",
                 self.producer_id, len(self.records))
        await self.session.hello()
        try:
            await run_tasks(self.producer_id, [self._listen(), self._heartbeat(),
                                               self._evaluate_versions()])
        finally:
            self.weights.close()


async def evaluator_main(cfg: RunConfig, index: int, model_path: str, engines: int,
                         stop_when_learner_done: bool = False) -> None:
    """Entry point of the evaluator process: engine ``index`` of the ``engines`` on its machine
    (its cores on a CPU machine are its own, ``pipeline.producer.engine.cpu_cores``)."""
    async with engine_process(cfg, index, model_path, (index, engines), EVALUATOR_ID) as parts:
        await Evaluator(cfg, parts.engine, parts.tokenizer, parts.endpoint, parts.rewards,
                        stop_when_learner_done).run()
