"""The dedicated evaluator (``eval.producer: dedicated``): an evaluation-only process with its own
vLLM engine that evaluates each due weights version as the learner announces it, so that no
producer ever pauses its rollouts for evaluation.

It speaks the producers' control protocol under its own id (``pipeline.schedule.EVALUATOR_ID``):
Hello, Heartbeat (its counters) and EvalResult (the figures, tagged with the version they
measure). It sends no group, no Ack and no SyncReady: the learner never waits for it, and it has
no admission share and no data shard. Weights come from each version's snapshot file (streamed
to its node first with ``sync.stream_from``), or as a LoRA adapter under adapter-only sync.

Which versions: once an evaluation is done, the newest announced version, if it is due and not
evaluated yet. A due version announced and superseded while the evaluator was busy is skipped
and counted (``versions_skipped``): its file may be gone by then, and an evaluator that queued
every version would fall ever further behind a learner that publishes faster than it
evaluates. The run's last version is the newest one at the end, so it is always evaluated.

Invariant: every completion of one evaluation comes from one version; one coroutine loads a
version and then evaluates it, so no swap can start during an evaluation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from buffer.protocol import Announce, EvalResult, Heartbeat, Hello
from buffer.transport import ProducerEndpoint
from pipeline.config import RunConfig
from pipeline.producer.adapters import AdapterSet
from pipeline.producer.engine import merge_adapters_on_load, weight_routes
from pipeline.producer.episode import load_episode
from pipeline.producer.evaluate import EpisodeRun, eval_records, generate_and_score
from pipeline.producer.process import engine_process
from pipeline.producer.rewards.runner import RewardSet
from pipeline.producer.session import LearnerFinished, LearnerSession, run_tasks
from pipeline.schedule import EVALUATOR_ID, is_due, last_version, skipped
from sync.barrier import RequestTracker, SwapBarrier, SwapReport
from sync.lora import adapter_config
from sync.routes.base import swap_with_fallback
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0


class Evaluator:
    def __init__(self, cfg: RunConfig, engine: Any, tokenizer: Any, endpoint: ProducerEndpoint,
                 rewards: RewardSet, stop_when_learner_done: bool = False):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.endpoint, self.rewards = endpoint, rewards
        self.stop_when_learner_done = stop_when_learner_done
        self.producer_id = EVALUATOR_ID
        self.incarnation = f"{EVALUATOR_ID}-{os.getpid()}-{time.time_ns() % 10**12}"
        self.session = LearnerSession(
            endpoint, lambda: Hello(producer_id=self.producer_id, incarnation=self.incarnation,
                                    policy_version=self.tracker.version, pid=os.getpid()),
            "the learner refused the evaluator: it runs without one (eval.producer differs "
            "between the roles?)")
        self.records = eval_records(cfg.data, cfg.eval)
        self.last = last_version(cfg.train.steps, cfg.sync.sync_every)
        self.tracker = RequestTracker()
        s = cfg.sync
        self.barrier = SwapBarrier(engine, self.tracker, mode=s.barrier,
                                   drain_timeout_s=s.drain_timeout_s,
                                   pause_timeout_s=s.pause_timeout_s,
                                   load_timeout_s=s.load_timeout_s)
        self.routes = weight_routes(engine, cfg, self.producer_id, self._no_link)
        self.adapters: AdapterSet | None = None
        t = cfg.train
        self.serving = cfg.adapter_plan.serving
        if self.serving == "lora":
            self.adapters = AdapterSet(
                engine, f"lora-{self.producer_id}-{os.getpid()}",
                adapter_config(t.lora_rank, t.lora_alpha, list(t.lora_target_modules)))
        fn = load_episode(cfg.episode.fn) if cfg.episode.fn else None
        self.episodes = EpisodeRun(fn, cfg.episode, cfg.rewards.on_failure) if fn else None
        self.base = True  # the engine holds the model's own weights (version 0)
        self.evaluated: set[int] = set()
        self.previous = -1  # the version evaluated last
        self.latest: Announce | None = None
        self._announced = asyncio.Event()
        self.stats = {"evaluations": 0.0, "versions_skipped": 0.0, "eval_s": 0.0, "swaps": 0.0,
                      "swap_failures": 0.0}

    async def _no_link(self, purpose: str, epoch: int, version: int) -> None:
        raise RuntimeError("the evaluator loads snapshot files only")

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
                            "evaluated", self.producer_id, ann.version, self.tracker.version)
            return self.base
        if not self.base and self.tracker.version == ann.version:
            return True
        ref = SnapshotRef(ann.version, ann.snapshot_uri, ann.snapshot_checksum)
        if self.adapters is not None:
            report: SwapReport = await self.adapters.swap(ref, self.tracker)
        else:
            report = await swap_with_fallback(self.barrier, "file", ref, self.routes["file"])
        self.stats["swaps" if report.ok else "swap_failures"] += 1
        if not report.ok:
            log.warning("%s: v%d not loaded, so not evaluated: %s", self.producer_id,
                        ann.version, report.error)
            return False
        self.base = False
        return True

    async def _evaluate(self, v: int) -> None:
        """Evaluate the loaded version ``v`` and send its figures."""
        self.evaluated.add(v)
        stats = await generate_and_score(
            self.engine, self.tokenizer, self.cfg.data, self.cfg.eval,
            self.cfg.generation.max_tokens, self.cfg.engine.max_model_len, self.records,
            self.rewards, v,
            lora_request=self.adapters.requests.get(v) if self.adapters is not None else None,
            episodes=self.episodes)
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
                                              policy_version=self.tracker.version,
                                              stats=dict(self.stats)))
            await asyncio.sleep(HEARTBEAT_S)

    async def run(self) -> None:
        if self.serving == "merge":
            await merge_adapters_on_load(self.engine, self.cfg, self.producer_id)
        log.info("%s: engine ready; %d held-out prompts; waiting for the learner's announces",
                 self.producer_id, len(self.records))
        await self.session.hello()
        try:
            await run_tasks(self.producer_id, [self._listen(), self._heartbeat(),
                                               self._evaluate_versions()])
        finally:
            for route in self.routes.values():
                route.close()
            if self.adapters is not None:
                self.adapters.close()


async def evaluator_main(cfg: RunConfig, index: int, model_path: str, engines: int,
                         stop_when_learner_done: bool = False) -> None:
    """Entry point of the evaluator process: engine ``index`` of the ``engines`` on its machine
    (its cores on a CPU machine are its own, ``pipeline.producer.engine.cpu_cores``)."""
    async with engine_process(cfg, index, model_path, (index, engines), EVALUATOR_ID) as parts:
        await Evaluator(cfg, parts.engine, parts.tokenizer, parts.endpoint, parts.rewards,
                        stop_when_learner_done).run()
