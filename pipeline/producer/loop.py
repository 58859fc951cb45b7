"""A producer: one vLLM AsyncLLM turning prompts into scored GRPO groups, pushed to the learner.

Three coroutines under one TaskGroup (an error in any stops the producer):
- ``_admit``: starts a group whenever the admission budget allows (``buffer.staleness.may_admit``:
  in-flight + sent-but-not-yet-consumed groups <= this producer's share of
  (max_staleness + 1 - the engine's lag behind the learner) x batch_groups, and of the groups
  the learner's remaining steps train), so no generation is spent on a group that would be too
  stale to train or that comes after the run's last step. The group itself (generate, score,
  send or drop) is the producer's ``GroupRollout``'s (``pipeline.producer.group``). With
  ``generation.dynamic_sampling`` a scored group whose rewards are all equal is dropped before
  it is sent (counted; at most a cap per learner step, ``pipeline.producer.sampling``) and its
  slot goes to a new admission, checked like any other;
- ``_listen``: applies announces: new snapshot -> sync barrier -> ack; consumption counts.
  The weights come by the route the learner names for us (file, ipc or nccl), loaded by the
  engine's ``EngineWeights`` (``pipeline.producer.weights``: a GPU route that fails is followed
  by a file swap to the same version);
- ``_heartbeat``: liveness and stats for the learner;
- ``_leave``: in an elastic run (``max_producers``), on SIGUSR1 (``pipeline-train scale``) the
  producer leaves cleanly: it starts no more groups, sends those it started, tells the learner
  (``Leave``) and exits once the learner's checkpoint holds them. The admission share and data
  shard are the producer's rank among ``Announce.members``, so the others take over its share.
The first of the members also evaluates (``eval.every``, unless ``eval.producer`` is
'dedicated': then the evaluator does, ``pipeline.producer.evaluation.Evaluator``): on each due
version, once loaded and before new admissions, it runs the held-out prompts and sends their
figures in an EvalResult (never as groups: ``pipeline.producer.evaluation``). A leaving
producer keeps the role until the learner takes it out of the members (and finishes an
evaluation under way before it exits); then the next member takes it with the version it runs.
A new learner session (a restarted learner trains its versions again) evaluates them again.
Control messages (Hello, Heartbeat, Ack, SyncReady) go on the control channel and each gets an
answer (``buffer.protocol``); groups go on the data channel only after the learner has welcomed
this incarnation, and a learner that no longer knows us (restarted) gets a new Hello.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

from buffer import protocol
from buffer.staleness import groups_to_go, may_admit, producer_budget
from buffer.transport import ProducerEndpoint
from pipeline.config import RunConfig
from pipeline.procs import dropped_lines
from pipeline.producer.data import PromptSource, render_prompt
from pipeline.producer.engine import engine_devices, engine_progress
from pipeline.producer.episode import load_episode
from pipeline.producer.evaluation import EpisodeRun, eval_records, generate_and_score
from pipeline.producer.group import GroupRollout
from pipeline.producer.outbox import Outbox
from pipeline.producer.process import engine_process
from pipeline.producer.rewards.call import rate_limiter
from pipeline.producer.rewards.runner import RewardSet
from pipeline.producer.sampling import DropCap, extra_cap
from pipeline.producer.session import (
    CONTROL_TIMEOUT_S,
    LearnerFinished,
    LearnerSession,
    ProducerLeft,
    run_tasks,
)
from pipeline.producer.stats import ProducerStats
from pipeline.producer.weights import EngineWeights, weight_routes
from pipeline.schedule import engine_count, evaluator_index, is_due, last_version
from sync.barrier import SwapReport
from sync.routes import takes_gpu_copy
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)
LEAVE_DURABLE_S = 300.0  # a leaving producer waits this long for the checkpoint of its groups


class Producer:
    def __init__(self, cfg: RunConfig, index: int, engine: Any, tokenizer: Any,
                 endpoint: ProducerEndpoint, rewards: RewardSet, prompts: PromptSource,
                 stop_when_learner_done: bool = False):
        self.cfg, self.index = cfg, index
        # --role producer: nobody else stops us. (Under --role all the launcher does, after
        # the learner process has exited; exiting first would look like a producer crash.)
        self.stop_when_learner_done = stop_when_learner_done
        self.producer_id = f"p{index}"
        self.engine, self.tokenizer, self.endpoint = engine, tokenizer, endpoint
        self.rewards, self.prompts = rewards, prompts
        # The version the engine runs and how the next one gets in: the producer end of each
        # route the learner may name (sync.routes; "file" is read where the learner wrote it, or
        # streamed to this node first, sync.stream_from), the barrier, LoRA adapters.
        final = cfg.generation.stream == "final"
        self.weights = EngineWeights(
            engine, cfg, self.producer_id,
            weight_routes(engine, cfg, self.producer_id, self._send_ready),
            probe=partial(engine_progress, engine) if final else None)
        # The run's producers now (Announce.members): our rank among them is our admission
        # share and data shard. Until the first announce: the producers the run starts with.
        self.members = [f"p{i}" for i in range(cfg.num_producers)]
        self.leave_requested = asyncio.Event()  # SIGUSR1: leave the run (elastic runs)
        self.leaving = False
        self.stats = ProducerStats()
        self._failures_version = -1  # the learner version of the last failure summary
        self.held = 0            # our groups in the learner's buffer (from announces)
        self.accepted = 0        # groups of this process the learner has (from announces)
        self.learner_session = ""
        self._loaded_session = ""  # the learner session whose snapshot the engine runs
        # Exactly-once delivery across learner restarts: this incarnation numbers its groups
        # (GroupRollout.seq) and the outbox keeps each until the learner announces it durable (in
        # a checkpoint); a restored learner gets the rest again and drops what it already has
        # (buffer.ledger).
        self.incarnation = f"{self.producer_id}-{os.getpid()}-{time.time_ns() % 10**12}"
        self.outbox = Outbox(Path(cfg.run_dir) / "producers", self.producer_id, self.incarnation,
                             cfg.sync.retain_groups)
        self.session = LearnerSession(
            endpoint, self._make_hello, f"the learner refused {self.producer_id}: its run has "
            "fewer producers (num_producers, or max_producers for one that joins, differs "
            "between the roles?)")
        self._budget_changed = asyncio.Event()
        self._synced = asyncio.Event()   # set once we hold the learner's current version
        self._group_tasks: set[asyncio.Task] = set()
        self._engine_lock = asyncio.Lock()  # sleep, wake and swap never interleave
        self._asleep = False
        self.learner_heading_to = 0  # Announce.heading_to: see buffer.staleness.may_admit
        self.learner_to_go: int | None = None  # groups the run still trains on (Announce)
        # generation.dynamic_sampling: uninformative groups dropped, at most a cap per learner
        # step (pipeline.producer.sampling); the step is told by the groups the learner took.
        g = cfg.generation
        drop_cap = DropCap(extra_cap(cfg.train.batch_groups, g.dynamic_sampling_max_extra,
                                     *self.share() or (1, 0))) if g.dynamic_sampling else None
        self._counted = asyncio.Event()  # a group was sent or dropped: heartbeat its counters
        # Multi-turn episodes (episode.fn): G of them make a group instead of G completions.
        episode_fn = load_episode(cfg.episode.fn) if cfg.episode.fn else None
        self.rollout = GroupRollout(cfg, self.producer_id, index, self.incarnation, engine,
                                    tokenizer, self.weights, rewards, self.outbox, endpoint,
                                    self.stats, self._counted, drop_cap, episode_fn)
        # Shared evaluation (eval.every, no dedicated evaluator): the first of the members
        # evaluates (one evaluation per version, whatever the producer count), so the role
        # moves on when that producer leaves (every producer holds the held-out prompts).
        ev = cfg.eval
        self.evaluates_shared = bool(ev.every) and \
            evaluator_index(cfg.producer_slots, ev.every, ev.producer) is None
        self.eval_records = eval_records(cfg.data, ev) if self.evaluates_shared else []
        self.eval_episodes = EpisodeRun(episode_fn, cfg.episode, cfg.rewards.on_failure) \
            if episode_fn is not None else None
        self.eval_last = last_version(cfg.train.steps, cfg.sync.sync_every)
        self._evaluated: set[int] = set()
        self._evaluating = False  # an evaluation runs: a leave waits for its figures

    # ------------------------------------------------------------------ admission
    def share(self) -> tuple[int, int] | None:
        """(producers, our rank) among the run's members; None while we are not one (we joined
        and no announce has named us yet, or we are leaving): then we start no group."""
        if self.leaving or self.producer_id not in self.members:
            return None
        return len(self.members), self.members.index(self.producer_id)

    @property
    def budget(self) -> int:
        """Our share of the admission budget now, before the engine's lag shrinks it (0 while
        we are not a member)."""
        share = self.share()
        t = self.cfg.train
        return producer_budget(t.batch_groups, t.max_staleness, *share) if share else 0

    def _on_members(self, members: list[str]) -> None:
        """Producers joined or left: our admission share and drop cap follow (the data follows
        the learner's leases, ``Announce.leases``)."""
        self.members = members
        share = self.share()
        if share is None:
            return
        if self.rollout.drop_cap is not None:
            self.rollout.drop_cap.cap = extra_cap(
                self.cfg.train.batch_groups, self.cfg.generation.dynamic_sampling_max_extra,
                *share)
        log.info("%s: the run has %d producer(s) now (%s); admission share %d of %d",
                 self.producer_id, share[0], ", ".join(members), share[1], share[0])

    def may_start(self) -> bool:
        """Whether the admission budget lets us start one more group now (never while a
        group waits for room on the disk to be logged: ``Outbox.record``)."""
        share = self.share()
        return self._synced.is_set() and share is not None and not self.outbox.full and may_admit(
            self.outstanding(), self.cfg.train.batch_groups, self.cfg.train.max_staleness,
            *share, self.weights.version, self.learner_heading_to, self.learner_to_go)

    @property
    def in_flight_groups(self) -> int:
        """Groups generating or being scored (``GroupRollout.generating``)."""
        return self.rollout.generating

    def outstanding(self) -> int:
        """Groups generating, in transit, or waiting in the learner's buffer."""
        in_transit = max(self.rollout.seq - self.accepted, 0)
        return self.in_flight_groups + in_transit + self.held

    async def _admit(self) -> None:
        await self._synced.wait()
        rate = self.cfg.generation.admit_rate_per_s
        throttle = rate_limiter(rate) if rate else contextlib.nullcontext()
        told = False
        while True:
            # The budget and a prompt to read first, then the engine awake and the throttle,
            # then the budget again and the prompt taken with no await until its group starts:
            # a prompt taken is read for good (the learner leases each position once, and a
            # Leave hands back only what lies past our cursor), so none is taken while a leave,
            # a re-split or a full disk can still stop this admission.
            while not self.may_start() or not self.prompts.has_next():
                if self.may_start() and not told:
                    told = True
                    log.info("%s: waiting for the learner to lease more prompts",
                             self.producer_id)
                self._budget_changed.clear()
                await self._sleep_if_idle()
                await self._budget_changed.wait()
            await self._wake()
            async with throttle:  # asyncio-throttle: at most `rate` admissions per second
                pass
            if not self.may_start() or (record := self.prompts.take()) is None:
                continue
            ids = render_prompt(self.tokenizer, self.cfg.data, record.prompt)
            if len(ids) > self.cfg.data.max_prompt_tokens or \
                    len(ids) + 1 >= self.cfg.engine.max_model_len:
                self.stats.prompts_skipped_too_long += 1
                continue
            self.stats.groups_started += 1
            task = self.rollout.start(record, ids)
            self._group_tasks.add(task)
            task.add_done_callback(self._group_done)

    async def _sleep_if_idle(self) -> None:
        """engine.sleep_when_idle: with nothing generating and the budget spent (sync mode:
        the batch is sent, the learner trains), free the engine's GPU memory until the next
        version. Level 1: the weights wait in host memory, so a failed swap still has them."""
        if not self.cfg.engine.sleep_when_idle or self._asleep or self.in_flight_groups:
            return
        async with self._engine_lock:
            if self._asleep or self.in_flight_groups:
                return
            t0 = time.monotonic()
            await self.engine.sleep(level=1)
            self._asleep = True
            if not self.stats.sleeps:
                log.info("%s: engine sleeps while it waits for a version (engine.sleep_when_idle)",
                         self.producer_id)
            self.stats.sleeps += 1
            self.stats.sleep_s += time.monotonic() - t0

    async def _wake(self) -> None:
        """Before a swap or an admission: the engine needs its weights and KV cache back."""
        if not self._asleep:
            return
        async with self._engine_lock:
            if not self._asleep:
                return
            t0 = time.monotonic()
            await self.engine.wake_up()
            self._asleep = False
            self.stats.wake_s += time.monotonic() - t0

    def _group_done(self, task: asyncio.Task) -> None:
        self._group_tasks.discard(task)
        self._budget_changed.set()
        if not task.cancelled() and task.exception() is not None:
            # A group failing is a bug in our code or the engine: stop the producer loudly.
            self._fatal = task.exception()
            self._budget_changed.set()

    # ------------------------------------------------------------------ control
    async def _listen(self) -> None:
        while True:
            ann = await self.endpoint.recv_announce(timeout=1.0)
            if ann is None:
                continue
            # Each announce carries the learner's whole state, so only the newest queued one
            # matters: after a long wait (an engine start, a swap) the older ones would only
            # name snapshot files the learner has since pruned.
            while (newer := await self.endpoint.recv_announce(timeout=0)) is not None:
                ann = newer
            await self._apply_announce(ann)

    async def _apply_announce(self, ann: protocol.Announce) -> None:
        self.outbox.forget_durable(ann.durable)
        if ann.version != self._failures_version:  # a learner step: one line for its failures
            self._failures_version = ann.version
            self.rollout.summarise_failures(ann.version)
        if ann.finished and self.stop_when_learner_done:
            raise LearnerFinished(f"learner session {ann.learner_session} trained its last "
                                  f"step (version {ann.version})")
        if ann.learner_session != self.learner_session:
            # New learner (first contact or a restart): resend what its checkpoint lacks, ours
            # and any a killed predecessor left in its log (the learner drops duplicates).
            # Resends do not count against admission: they were budgeted when first sent.
            if self.learner_session:
                # A restarted learner knows us only from heartbeats: tell it our GPUs again, or
                # it routes our weights by file for good.
                await self._hello()
            self.learner_session = ann.learner_session
            resend = self.outbox.unconfirmed()
            for group in resend:
                await self.endpoint.send(group)
            self.stats.groups_resent += len(resend)
            # Prompts the learner already has, or is sent again now (a killed predecessor's
            # log: the same leases), are not generated again after a restart.
            resent = (g.metadata.get("cursor") for g in resend)
            self.prompts.cursor = max(self.prompts.cursor, ann.cursors.get(self.producer_id, 0),
                                      *(c for c in resent if isinstance(c, int)))
            self._evaluated.clear()  # a restored learner trains its versions again
            log.info("%s: learner session %s at version %d", self.producer_id,
                     ann.learner_session, ann.version)
        route = ann.routes.get(self.producer_id, "file")
        await self.weights.connect(route, ann.transfer)
        ref = self._target(ann, route)
        if ref is not None and not self._holds(ref, ann.learner_session):
            self._synced.clear()  # generate nothing more on weights the learner has left
            await self._wake()
            async with self._engine_lock:
                report = await self.weights.load(ref, route, ann.transfer)
            if report is not None:
                await self._report(report, ann.learner_session)
        pid = self.producer_id
        if pid in ann.leases:
            self.prompts.lease_from(ann.leases[pid])
        if ann.members and ann.members != self.members:
            self._on_members(list(ann.members))
        self.learner_heading_to = ann.heading_to
        self.learner_to_go = groups_to_go(ann.last_step, ann.steps_taken,
                                          self.cfg.train.batch_groups)
        self.rollout.learner_consumed = sum(ann.consumed.values())
        self.held = max(ann.received.get(pid, 0) - ann.consumed.get(pid, 0), 0)
        self.accepted = ann.accepted.get(self.incarnation, 0)
        if ref is None and self._loaded_session != ann.learner_session:
            # The learner's base weights: nothing to load.
            self.weights.tracker.version = ann.version
        if ref is None or self._holds(ref, ann.learner_session):
            await self._evaluate_if_due()
            self._synced.set()
        self._budget_changed.set()

    def evaluates_now(self) -> bool:
        """Shared evaluation: whether the role is ours, the first member's. A leaving producer
        keeps it until the learner takes it out of the members (its Leave): the next member
        only takes the role from the announce that no longer names it, so no version falls
        between the two."""
        return self.evaluates_shared and self.members[:1] == [self.producer_id]

    async def _evaluate_if_due(self) -> None:
        """Evaluate the version just loaded, if due, before admitting on it. Groups already
        generating go on meanwhile; no swap can start, as this runs inside the announce
        handler, so every evaluation completion comes from this one version."""
        v = self.weights.version
        if not self.evaluates_now() or v in self._evaluated or \
                not is_due(v, self.cfg.eval.every, self.eval_last):
            return
        self._evaluated.add(v)
        self._evaluating = True
        try:
            await self._wake()
            stats = await generate_and_score(
                self.engine, self.tokenizer, self.cfg.data, self.cfg.eval,
                self.cfg.generation.max_tokens, self.cfg.engine.max_model_len,
                self.eval_records, self.rewards, v, lora_request=self.weights.lora_request(v),
                episodes=self.eval_episodes)
            log.info("%s: eval v%d: %s", self.producer_id, v,
                     ", ".join(f"{k.removeprefix('eval/')} {x:.3g}" for k, x in stats.items()))
            answer = await self._control(protocol.EvalResult(
                producer_id=self.producer_id, incarnation=self.incarnation, version=v,
                stats=stats))
        finally:
            self._evaluating = False
        if answer is None or not answer.ok:
            log.warning("%s: the learner did not take the evaluation of v%d: %s",
                        self.producer_id, v, answer.reason if answer else "no answer")

    def _holds(self, ref: SnapshotRef, learner_session: str) -> bool:
        """Whether the engine runs ``ref``'s weights: its version, loaded from that learner
        session (a restarted learner trains its versions anew: the same number from another
        session is other weights)."""
        return self.weights.version == ref.version and self._loaded_session == learner_session

    def _target(self, ann: protocol.Announce, route: str) -> SnapshotRef | None:
        """The version to run next, or None when there is nothing to load.

        The GPU copy on offer (``transfer["version"]``, our route ipc or nccl) when it is newer
        than the newest file: the learner announces it before its file is written; such a ref
        has no file (``uri`` ""). Else the file. Never an older version than the one we run
        from the same learner: the file of a version we took by GPU arrives later, and the
        file of the one before it meanwhile."""
        gpu = ann.transfer.get("version") if takes_gpu_copy(route) else None
        if type(gpu) is int and gpu > ann.version:
            ref = SnapshotRef(gpu, "", "")
        elif ann.snapshot_uri:
            ref = SnapshotRef(ann.version, ann.snapshot_uri, ann.snapshot_checksum)
        else:
            return None
        if self._loaded_session == ann.learner_session and ref.version < self.weights.version:
            return None
        return ref

    async def _report(self, report: SwapReport, learner_session: str) -> None:
        barrier = self.weights.barrier
        self.stats.swaps = barrier.swaps
        self.stats.swap_failures = barrier.failures
        if report.timings.get("fallback"):
            self.stats.transport_fallbacks += 1
        if report.ok:
            self._loaded_session = learner_session
        else:
            log.error("%s: %s", self.producer_id, report.error)
        t = report.timings
        if t.get("drain_s", 0.0) > 1.0:  # what a slow swap waited for, in this producer's log
            log.info("%s: v%d: the drain took %.2f s: %d prefill(s) under way, %d request(s) "
                     "restarted, %d group(s) generating", self.producer_id, report.version,
                     t["drain_s"], t.get("drain_waited", 0), t.get("drain_resubmitted", 0),
                     self.in_flight_groups)
        answer = await self._control(protocol.Ack(
            producer_id=self.producer_id, incarnation=self.incarnation, version=report.version,
            ok=report.ok, error=report.error[:16384], timings=report.timings))
        if answer is None:
            log.warning("%s: the learner did not answer our ack of v%d within %.0f s",
                        self.producer_id, report.version, CONTROL_TIMEOUT_S)

    def _make_hello(self) -> protocol.Hello:
        """This incarnation's Hello: its version, GPUs and the dead incarnations it resends."""
        return protocol.Hello(
            producer_id=self.producer_id, incarnation=self.incarnation,
            policy_version=self.weights.version, pid=os.getpid(), devices=self.weights.devices,
            recovered=self.outbox.incarnations_recovered, leaving=self.leaving)

    async def _hello(self) -> None:
        await self.session.hello()

    async def _control(self, msg: protocol.ControlMessage) -> protocol.Reply | None:
        return await self.session.call(msg)

    async def _send_ready(self, purpose: str, epoch: int, version: int) -> None:
        """Tell the learner our side of a NCCL link is ready ("drop": given up). Raises if the
        learner did not take it, so the GPU route fails over to the file at once."""
        answer = await self._control(protocol.SyncReady(
            producer_id=self.producer_id, incarnation=self.incarnation, purpose=purpose,
            epoch=epoch, version=version))
        if purpose != "drop" and (answer is None or not answer.ok):
            raise RuntimeError(f"the learner did not take SyncReady({purpose!r}, epoch {epoch}): "
                               f"{answer.reason if answer else 'no answer'}")

    def heartbeat_stats(self) -> dict[str, float]:
        """Every counter of this process (``pipeline.producer.stats`` and the rewards'
        ``reward/<name>/<kind>``, once the rewards have run): the learner logs them to
        metrics.jsonl and TensorBoard."""
        return {**self.stats.to_dict(),
                # run_dir's disk full: the pauses, their seconds, and the lines of this
                # process's output its log file could not take (pipeline.procs.LogStream).
                "disk_full_pauses": float(self.outbox.full_pauses),
                "disk_full_s": self.outbox.full_s, "log_lines_dropped": float(dropped_lines()),
                **{k: float(v) for k, v in self.rewards.reported_stats().items()}}

    async def _heartbeat(self) -> None:
        while True:
            # Also right after a group: the learner's metrics row for the step that trains it
            # then carries the counters that include it (reward failures of that group).
            self._counted.clear()
            await self._control(protocol.Heartbeat(
                producer_id=self.producer_id, incarnation=self.incarnation,
                policy_version=self.weights.version, stats=self.heartbeat_stats(),
                cursor=self.prompts.cursor, leaving=self.leaving))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._counted.wait(), 2.0)

    async def _leave(self) -> None:
        """Leave the run cleanly once asked (SIGUSR1): nothing started is lost. The learner
        takes us out of its members when every group we started has reached it, and writes
        them into its next checkpoint; we exit once it announces them durable (our outbox log
        keeps any it has not, for a producer with our id to resend, if that takes too long)."""
        await self.leave_requested.wait()
        self.leaving = True  # share() is None from now: _admit starts nothing more
        self._budget_changed.set()
        self._counted.set()  # a heartbeat now tells the learner we are leaving
        log.info("%s: leaving the run: finishing %d group(s) in flight", self.producer_id,
                 self.in_flight_groups)
        while self.in_flight_groups or self.accepted < self.rollout.seq:
            self._budget_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._budget_changed.wait(), 1.0)
        answer = await self._control(protocol.Leave(
            producer_id=self.producer_id, incarnation=self.incarnation, sent=self.rollout.seq,
            cursor=self.prompts.cursor))
        if answer is None or not answer.ok:
            raise RuntimeError(f"the learner did not take our Leave: "
                               f"{answer.reason if answer else 'no answer'}")
        deadline = time.monotonic() + LEAVE_DURABLE_S
        while self.outbox.unconfirmed() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        until = time.monotonic() + self.cfg.eval.timeout_s
        while self._evaluating and time.monotonic() < until:
            await asyncio.sleep(0.1)  # a version evaluated before our Leave: send its figures
        left = len(self.outbox.unconfirmed())
        if left:
            log.warning("%s: %d group(s) not yet in a learner checkpoint after %.0f s; they stay "
                        "in %s for a producer with this id to resend", self.producer_id, left,
                        LEAVE_DURABLE_S, self.outbox.dir)
        sent = self.rollout.seq
        raise ProducerLeft(f"left the run after {sent} group(s), "
                           f"{sent - left} in the learner's checkpoint")

    async def _watch(self) -> None:
        while True:
            await self._budget_changed.wait()
            err = getattr(self, "_fatal", None)
            if err is not None:
                raise err
            await asyncio.sleep(0.05)

    async def run(self) -> None:
        self.weights.devices = await engine_devices(self.engine)
        await self.weights.start()
        log.info("%s: engine ready; waiting for the learner's first announce", self.producer_id)
        await self._hello()
        try:
            await run_tasks(self.producer_id, [self._listen(), self._heartbeat(), self._admit(),
                                               self._watch(), self._leave()])
        finally:
            self.rollout.summarise_failures(max(self._failures_version, 0))
            self.rollout.close()
            self.outbox.close()
            self.weights.close()
            for t in list(self._group_tasks):
                t.cancel()
            for rid in list(self.weights.tracker.in_flight):
                with contextlib.suppress(Exception):
                    await self.engine.abort(rid)


async def producer_main(cfg: RunConfig, index: int, model_path: str, start_cursor: int = 0,
                        stop_when_learner_done: bool = False) -> None:
    """Entry point of a producer process (called under ``if __name__ == '__main__'``)."""
    asked: list[int] = []  # SIGUSR1 while the engine starts: leave once the producer runs
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
    # It reads only what the learner leases it (Announce.leases): nothing before the first.
    prompts = PromptSource(cfg.data, start_cursor=start_cursor)
    prompts.lease(0, [])
    engines = engine_count(cfg.producer_slots, cfg.eval.every, cfg.eval.producer)
    async with engine_process(cfg, index, model_path, (index, engines), f"p{index}") as parts:
        producer = Producer(cfg, index, parts.engine, parts.tokenizer, parts.endpoint,
                            parts.rewards, prompts, stop_when_learner_done)
        # pipeline-train scale (or kill -USR1): leave the run cleanly.
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1,
                                                      producer.leave_requested.set)
        if asked:
            producer.leave_requested.set()
        await producer.run()
