"""The rollout of one group: G completions (or G episodes) generated, scored and sent.

``GroupRollout.start`` is what the producer's admission loop (``pipeline.producer.loop``) calls
for each admitted prompt: it generates the group's completions through the barrier's
gate (``_generate_one``: each request waits while a swap is under way, carries its version's
cache salt and tags every delta with the version the engine holds), or with ``episode.fn`` its
G multi-turn episodes (``pipeline.producer.episode``); scores them (``rewards``); drops a group
whose reward failed or, under ``generation.dynamic_sampling``, whose rewards are all equal (at
most a cap per learner step); and hands the rest to the outbox and the data channel, numbered
(``seq``) for exactly-once delivery. Every group sent or dropped is one line in the sent log
(the producer side of the soak's conservation check).

One ``GroupRollout`` per producer, held by ``Producer``: it owns the numbering of the groups it
sends (``seq``), the sent log, the dynamic-sampling drop cap and the episode failure log; it
shares the producer's engine and its weights (``pipeline.producer.weights``: the tracker and the
adapters every request goes through), rewards, outbox, endpoint and counters.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from typing import Any

import numpy as np

from buffer.schema import Completion, RolloutGroup
from pipeline.appendfile import AppendFile
from pipeline.config import RunConfig
from pipeline.producer.data import PromptRecord
from pipeline.producer.episode import (
    EpisodeResult,
    FailureLog,
    episode_limits,
    run_episodes,
    score_episodes,
)
from pipeline.producer.outbox import Outbox
from pipeline.producer.sampling import DropCap, is_uninformative
from pipeline.producer.stats import ProducerStats
from pipeline.producer.trained_sampling import DEFAULT, distribution, engine_options
from pipeline.producer.weights import EngineWeights

log = logging.getLogger(__name__)


class GroupRollout:
    """The rollout of a producer's groups (see the module docstring)."""

    def __init__(self, cfg: RunConfig, producer_id: str, index: int, incarnation: str,
                 engine: Any, tokenizer: Any, weights: EngineWeights, rewards: Any,
                 outbox: Outbox, endpoint: Any, stats: ProducerStats, counted: asyncio.Event,
                 drop_cap: DropCap | None = None, episode_fn: Any = None):
        """``counted``: set whenever a group is sent or dropped (the producer then heartbeats
        its counters); ``drop_cap``: with ``generation.dynamic_sampling``; ``episode_fn``: with
        ``episode.fn``, G episodes make a group instead of G completions."""
        self.cfg, self.producer_id, self.index = cfg, producer_id, index
        self.incarnation = incarnation
        self.engine, self.tokenizer, self.weights = engine, tokenizer, weights
        self.rewards, self.outbox, self.endpoint = rewards, outbox, endpoint
        self.stats, self._counted = stats, counted
        self.drop_cap, self.episode_fn = drop_cap, episode_fn
        self.final = cfg.generation.stream == "final"
        self.episode_failures = FailureLog()
        self.seq = 0  # groups of this incarnation sent (exactly-once delivery, buffer.ledger)
        self.sent_log = outbox.dir / f"{incarnation}.jsonl"
        self._sent = AppendFile(self.sent_log)  # a line the disk has no room for waits
        self.learner_consumed = 0  # groups the learner has taken (Announce): the cap's step
        # Groups started and neither numbered for sending nor ended: the producer's admission
        # counts them as generating. A group leaves this count in the same step as it takes its
        # ``seq`` (then it counts as in transit), so it is never counted twice or not at all.
        self.generating = 0

    def start(self, record: PromptRecord, prompt_ids: list[int]) -> asyncio.Task:
        """Admit the group of ``record``: it counts as generating from now (before its task
        first runs) until it is numbered for sending or ends unsent."""
        self.generating += 1
        return asyncio.create_task(self._run(record, prompt_ids))

    async def _run(self, record: PromptRecord, prompt_ids: list[int]) -> None:
        """Generate, score and send (or drop) the group of ``record`` (the module docstring)."""
        try:
            group = await self._build(record, prompt_ids)
        finally:
            self.generating -= 1  # no await since _build numbered the group (seq)
        if group is not None:
            await self._send(group)

    async def _build(self, record: PromptRecord, prompt_ids: list[int]) -> RolloutGroup | None:
        """The group of ``record`` generated, scored and numbered (``seq``); None if dropped."""
        g = self.cfg.generation
        group_id = f"{self.producer_id}-{uuid.uuid4().hex[:12]}"
        admitted_at = time.time()
        t0 = time.perf_counter()
        meta = dict(record.meta, prompt_id=record.prompt_id)
        episodes = None
        if self.episode_fn is not None:  # multi-turn: G episodes (pipeline.producer.episode)
            episodes = await self._run_episodes(group_id, record, prompt_ids, meta)
            if episodes is None:
                self._drop(group_id, record.prompt_id, "an episode failed")
                return None
            completions = [(e.completion, e.text) for e in episodes]
        else:
            completions = await asyncio.gather(*(
                self._generate_one(f"{group_id}-{j}", prompt_ids, self._sampling())
                for j in range(g.group_size)))
        gen_s = time.perf_counter() - t0
        if any(versions_go_back(c.version_segments) for c, _text in completions):
            # Begun on weights of a learner then restarted from an older checkpoint, finished on
            # the restored ones: no version of the restored lineage produced its first tokens.
            self._not_sent("groups_dropped_restart", "dropped_restart", group_id, record.prompt_id)
            log.info("%s: group for prompt %s dropped: generated across a learner restart to an "
                     "older version", self.producer_id, record.prompt_id)
            return None
        if episodes is not None:
            scored = await score_episodes(self.rewards, record.prompt, episodes, meta)
        else:
            result = await self.rewards.score_group(
                record.prompt, [c[1] for c in completions], meta,
                completion_ids=[c[0].token_ids for c in completions])
            scored = None if result.dropped else (list(result.total), list(result.breakdown))
        if scored is None:
            self._drop(group_id, record.prompt_id, "a reward failed")
            return None
        totals, breakdowns = scored
        if self._uninformative(totals):  # its admission slot frees as it ends
            self._not_sent("groups_dropped_zero_variance", "dropped_zero_variance", group_id,
                           record.prompt_id)
            return None
        comps = []
        for (comp, _text), total, breakdown in zip(completions, totals, breakdowns, strict=True):
            comp.reward = float(total)
            comp.reward_breakdown = {k: float(v) for k, v in breakdown.items()}
            comps.append(comp)
        group = RolloutGroup(
            group_id=group_id, producer_id=self.producer_id, prompt_id=record.prompt_id,
            prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32), completions=comps,
            timing={"admitted_at": admitted_at, "generate_s": gen_s,
                    "reward_s": time.perf_counter() - t0 - gen_s},
            metadata={"cursor": record.cursor, "position": record.position,
                      "producer_index": self.index,
                      "incarnation": self.incarnation, "seq": self.seq})
        self.seq += 1
        return group

    async def _send(self, group: RolloutGroup) -> None:
        """Keep ``group`` in the outbox until the learner has it in a checkpoint, and send it
        (once logged: on a full disk it waits, ``Outbox.record``)."""
        group_id = group.group_id
        await self.outbox.record(group)
        self.stats.retention_overflow = self.outbox.overflow
        await self.endpoint.send(group)
        self._log_sent({"seq": group.metadata["seq"], "group_id": group_id,
                        "position": group.metadata["position"]})
        self.stats.groups_sent += 1
        self._counted.set()

    def _drop(self, group_id: str, prompt_id: str, why: str) -> None:
        """rewards.on_failure=drop: the group is not sent (counted and logged)."""
        counter = "groups_dropped_reward" if why == "a reward failed" else \
            "groups_dropped_episode"
        self._not_sent(counter, "dropped_by_reward", group_id, prompt_id)
        log.warning("group for prompt %s dropped: %s (on_failure=drop)", prompt_id, why)

    def _not_sent(self, counter: str, record: str, group_id: str, prompt_id: str) -> None:
        """A group that ends without being sent: counted in ``stats.<counter>``, written to the
        sent log under ``record`` (for conservation, ``bench.soak.tally``), and the heartbeat
        told."""
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self._log_sent({record: group_id, "prompt_id": prompt_id})
        self._counted.set()

    def _uninformative(self, rewards: list[float]) -> bool:
        """generation.dynamic_sampling: whether to drop this scored group as uninformative. Past
        the step's cap it is sent as it is, with one warning the first time and a count."""
        g = self.cfg.generation
        if self.drop_cap is None or not is_uninformative(rewards, g.dynamic_sampling_min_std):
            return False
        hits = self.drop_cap.capped_windows
        if self.drop_cap.drop(self.learner_consumed):
            return True
        if self.drop_cap.capped_windows > hits:
            self.stats.dynamic_sampling_cap_hits += 1
            log.log(logging.WARNING if hits == 0 else logging.INFO,
                    "%s: %d uninformative groups dropped in this learner step "
                    "(generation.dynamic_sampling_max_extra %g x its share of a batch); the "
                    "step's other groups are sent as they are", self.producer_id,
                    self.drop_cap.cap, g.dynamic_sampling_max_extra)
        return False

    def _sampling(self, **overrides: Any) -> Any:
        """The run's SamplingParams (``generation``), with an episode turn's overrides; raises
        ``UntrainableSampling`` for an override the learner could not train."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        g = self.cfg.generation
        opts = dict(max_tokens=g.max_tokens, stop=list(g.stop) or None, ignore_eos=g.ignore_eos,
                    **engine_options(g.temperature, g.top_p, g.top_k))
        opts.update(overrides)
        opts.update(engine_options(*distribution(opts, "episode turn" if overrides else
                                                 "generation")))
        return SamplingParams(
            n=1, logprobs=0,
            # vLLM detokenizes every token (and every logprob) in Python on the engine's
            # event loop; one decode per finished completion here costs a fraction of that.
            # Stop strings need vLLM's incremental text, so they keep it on.
            detokenize=bool(opts["stop"]),
            flat_logprobs=True,  # a few flat lists per request, not a dict per token
            seed=None, output_kind=RequestOutputKind.FINAL_ONLY if self.final
            else RequestOutputKind.DELTA, **opts)

    async def _run_episodes(self, group_id: str, record: PromptRecord, prompt_ids: list[int],
                            meta: dict[str, Any]) -> list[EpisodeResult] | None:
        """The group's G episodes, run concurrently; None when one failed and
        rewards.on_failure is drop. Each turn is one request through ``_generate_one``: it
        waits at the barrier's gate, carries its version's cache salt and version tags."""
        e = self.cfg.episode

        async def generate(rid: str, ids: list[int], overrides: dict[str, Any]
                           ) -> tuple[Completion, str]:
            return await self._generate_one(rid, ids, self._sampling(**overrides))

        results = await run_episodes(
            self.episode_fn, self.cfg.generation.group_size, generate=generate,
            tokenizer=self.tokenizer, prompt_ids=prompt_ids, limits=episode_limits(e),
            max_model_len=self.cfg.engine.max_model_len, request_prefix=group_id,
            version=lambda: self.weights.version, prompt=record.prompt,
            prompt_id=record.prompt_id, kwargs={**e.kwargs, **meta})
        st = self.stats
        for r in results:
            st.episodes += 1
            st.episode_turns += r.turns
            st.episode_tool_calls += r.tool_calls
            st.episode_env_tokens += r.env_tokens
            if r.failure:
                name = {"tool_timeout": "episode_tool_timeouts", "tool_error":
                        "episode_tool_errors", "timeout": "episode_timeouts"}.get(
                            r.failure, "episode_errors")
                setattr(st, name, getattr(st, name) + 1)
                log.log(*self.episode_failures.record(record.prompt_id, r.failure, r.detail))
        if any(r.failure for r in results) and self.cfg.rewards.on_failure == "drop":
            return None
        return results

    def summarise_failures(self, version: int) -> None:
        """One warning line counting the episode failures logged to the file only since the
        last one (``FailureLog``); ``version``: the learner's now."""
        line = self.episode_failures.summary(version)
        if line is not None:
            log.warning("%s: %s", self.producer_id, line)

    def _log_sent(self, record: dict[str, Any]) -> None:
        """One line per group handed to the transport: the producer side of the soak's
        conservation check (groups produced = trained + dropped + held)."""
        self._sent.append((json.dumps(record) + "\n").encode())  # on a full disk: later

    def close(self) -> None:
        """Write the sent log's lines that waited for room on the disk, and close it."""
        self._sent.retry()
        self._sent.close()

    async def _generate_one(self, rid: str, prompt_ids: list[int], sp: Any
                            ) -> tuple[Completion, str]:
        tokens: list[int] = []
        logprobs: list[float] = []
        segments: list[tuple[int, int]] = []
        text: list[str] = []
        attempt = 0
        while True:
            request_id = f"{rid}-a{attempt}"
            tracker, adapters = self.weights.tracker, self.weights.adapters
            version = await tracker.admit(request_id)
            # The salt keeps prefix-cache hits within one weights version: KV computed by old
            # weights is never reused for a request admitted after a swap.
            prompt = {"prompt_token_ids": prompt_ids, "cache_salt": f"v{version}"}
            finish = ""
            self.stats.busy.enter()
            # Adapter sync: the request keeps its version's adapter to the end, so every token
            # is that version's (no swap boundary falls inside it).
            lora = adapters.request_for(version) if adapters is not None else None
            try:
                async for out in self.engine.generate(prompt, sp, request_id,
                                                      lora_request=lora):
                    c = out.outputs[0]
                    new = list(c.token_ids)
                    v = tracker.on_output(request_id, len(new))
                    if new:
                        if adapters is not None:
                            segments = [(0, version)]
                        elif self.final:  # the one output: versions from the swap boundaries
                            segments = tracker.segments(request_id, version, len(new))
                        elif not segments or segments[-1][1] != v:
                            segments.append((len(tokens), v))
                        tokens.extend(new)
                        logprobs.extend(sampled_logprobs(c.logprobs, new))
                        text.append(c.text)
                    if out.finished:
                        finish = c.finish_reason or ""
                        # Prefix-cache reuse (an episode's later turns, a group's siblings).
                        self.stats.prompt_tokens += len(prompt_ids)
                        self.stats.prompt_tokens_cached += int(
                            getattr(out, "num_cached_tokens", 0) or 0)
            finally:
                tracker.finish(request_id)
                self.stats.busy.exit()
                if adapters is not None:
                    await adapters.release(version)
            if finish == "abort" and attempt < 100:
                # Aborted by a swap (abort mode, or not yet started at a drain_prefill swap):
                # regenerate from scratch under the new weights and their cache salt.
                tokens, logprobs, segments, text = [], [], [], []
                attempt += 1
                self.stats.completions_resubmitted += 1
                continue
            break
        self.stats.tokens += len(tokens)
        if not segments:
            segments = [(0, tracker.version)]
        # The distribution the tokens were drawn from, for the learner to recompute.
        dist = distribution({"temperature": sp.temperature, "top_p": sp.top_p,
                             "top_k": sp.top_k})
        comp = Completion(token_ids=np.asarray(tokens, dtype=np.int32),
                          logprobs=np.asarray(logprobs, dtype=np.float32),
                          version_segments=segments, finish_reason=finish,
                          sampling_segments=[] if dist == DEFAULT else [(0, *dist)])
        if not sp.detokenize:
            return comp, self.tokenizer.decode(tokens, skip_special_tokens=True)
        return comp, "".join(text)


def versions_go_back(segments: list[tuple[int, int]]) -> bool:
    """Whether a completion's (first token, version) runs ever go to an older version."""
    return any(b[1] < a[1] for a, b in itertools.pairwise(segments))


def sampled_logprobs(lp: Any, token_ids: list[int]) -> list[float]:
    """Behaviour logprob of each sampled token from vLLM's per-position logprob dicts."""
    if lp is None:
        return [math.nan] * len(token_ids)
    flat = getattr(lp, "start_indices", None) is not None  # vLLM's FlatLogprobs
    if flat and len(lp.logprobs) == len(token_ids) and list(lp.token_ids) == list(token_ids):
        return [float(x) for x in lp.logprobs]  # logprobs=0: one entry, the sampled token
    out = []
    for pos, tok in zip(lp, token_ids, strict=False):
        entry = pos.get(tok) if pos is not None else None
        out.append(float(entry.logprob) if entry is not None else math.nan)
    return out
