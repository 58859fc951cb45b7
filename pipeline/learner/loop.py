"""The learner process: receives groups into the rollout buffer, trains, publishes snapshots.

Four coroutines under one TaskGroup: ``_receive`` (data socket -> buffer, waiting while the
buffer is full), ``_control`` (control socket: Hello, Heartbeat, Ack, SyncReady, each answered
at once, whatever the buffer does), ``_announce`` (re-broadcasts the current version every
second, so producers that (re)connect catch up before they generate), and ``_train`` (batch ->
optimiser step in a worker thread -> snapshot -> announce). Sync mode is the same loop with
max_staleness 0 and admission budgets of exactly one batch: generate with v, train on that
batch, publish v+1.

Producers are known by their Hello (``buffer.identity``): groups and control messages from a
producer that has not said Hello, or from an incarnation it did not declare, are refused and
counted as ``rejected/<reason>``; only producers heard from lately count as alive.

Counts kept per producer: ``received`` (groups that arrived) and, derived, ``consumed`` (received
minus still held), which producers use for admission control.

Weights: every version is packed once and written as a snapshot file; producers whose route
(picked per producer from the GPUs in its Hello) has a GPU copy also get it from the packed
buffer. What is published on each route is ``pipeline.learner.routes``'s; this loop says when
(after each step that publishes) and collects the acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from buffer.checks import RunLimits, check_group
from buffer.identity import ProducerRegistry
from buffer.ledger import GroupLedger
from buffer.protocol import (
    Ack,
    Announce,
    ControlMessage,
    EvalResult,
    Heartbeat,
    Hello,
    Leave,
    Reply,
    SyncReady,
    Welcome,
)
from buffer.schema import RolloutGroup
from buffer.staleness import oldest_kept
from buffer.store import RolloutBuffer
from buffer.transport import LearnerEndpoint
from pipeline.config import RunConfig, completion_max_tokens
from pipeline.keys import curve_keys
from pipeline.learner.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    LearnerState,
    latest_checkpoint,
    load_checkpoint,
)
from pipeline.learner.disk import disk_free
from pipeline.learner.evaluations import Evaluations
from pipeline.learner.metrics import MetricsLogger, carry_counters, plot_run, producer_metrics
from pipeline.learner.producers import ALIVE_S, ProducerInfo
from pipeline.learner.roster import Roster
from pipeline.learner.routes import LearnerRoutes, serve_stream, snapshot_dir
from pipeline.learner.trackers import Trackers
from pipeline.learner.trainer import PolicyTrainer
from pipeline.options import to_dict
from pipeline.procs import LOGS_DIR, ConsoleStream
from sync.snapshot import SnapshotRef, drop_newer
from sync.writer import SnapshotWriter

log = logging.getLogger(__name__)
REJECT_LOG_LIMIT = 20  # warning lines per (producer, reason); later ones only count (DEBUG)
MAX_FAILED_STEPS = 10  # training steps raising in a row: the trainer is broken, not the data


class Learner:
    def __init__(self, cfg: RunConfig, model_path: str, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.session = uuid.uuid4().hex[:8]
        self.trainer = PolicyTrainer(cfg, model_path)
        self.state = LearnerState()
        buf_args = (cfg.buffer_capacity, cfg.train.max_staleness, cfg.buffer_order)
        self.buffer = RolloutBuffer(*buf_args)
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise CheckpointError(f"--resume: no checkpoint under {self.run_dir}/checkpoints")
            self.state, tensors, buf = load_checkpoint(ckpt)
            self.trainer.load_state(tensors, ckpt)
            self.buffer = RolloutBuffer.restore(buf, *buf_args)
            log.info("resumed from %s: step %d, version %d, %d groups buffered", ckpt,
                     self.state.step, self.state.version, len(self.buffer))
        # One snapshot dir per run (not per session): a learner restarted after kill -9 reuses
        # and prunes it instead of leaking the old one in shared memory.
        run_key = hashlib.sha1(str(self.run_dir.resolve()).encode()).hexdigest()[:12]
        model = self.trainer.model
        # An upper bound (frozen tensors stay home); ZeRO-3 parameters hold ds_numel.
        snapshot_bytes = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * \
            self.trainer.snapshot_dtype.itemsize
        self.snapshot_dir = snapshot_dir(cfg.sync.snapshot_dir, self.run_dir, run_key,
                                         (cfg.sync.keep_snapshots + 1) * snapshot_bytes)
        self.snapshot: SnapshotRef | None = None  # the newest snapshot file written
        self.writer = SnapshotWriter(self.snapshot_dir, cfg.sync.keep_snapshots,
                                     on_written=self._on_written)
        self._acks_tracked = 0  # newest version whose acks are being collected
        self._heading_to = 0  # version the step under way will publish (Announce.heading_to)
        self._steps_taken = self.state.step  # batches taken (Announce.steps_taken)
        self.producers: dict[str, ProducerInfo] = {}
        self.acks: dict[int, dict[str, Ack]] = {}
        self.last_sync: dict[str, float] = {}
        self.endpoint: LearnerEndpoint | None = None
        self.metrics = MetricsLogger(self.run_dir, tensorboard="tensorboard" in cfg.report_to,
                                     progress=cfg.progress, total_steps=cfg.train.steps,
                                     trackers=Trackers(cfg.report_to, self.run_dir, cfg.name,
                                                       to_dict(cfg)),
                                     stream=ConsoleStream())
        # Evaluation figures, and the dedicated evaluator (eval.producer), never a producer.
        self.evals = Evaluations(cfg, self.metrics)
        self.registry = ProducerRegistry({f"p{i}" for i in range(cfg.producer_slots)},
                                         evaluators=self.evals.ids)
        # Who shares the admission budget now, who is leaving, and who may read which prompts
        # (elastic runs: max_producers); on file, so a restarted learner keeps them.
        t = cfg.train
        self.roster = Roster.open(self.run_dir, cfg.num_producers,
                                  chunk=max(2 * (t.max_staleness + 1) * t.batch_groups, 8))
        self.members = self.roster.members
        self._read: dict[str, int] = {}  # data cursor per producer, from its heartbeats
        self._started = time.monotonic()
        self._checkpoint_soon = False  # a producer left: its groups go in the next checkpoint
        # The newest trained step and its metrics row as built so far, until the row is logged:
        # a stop between the optimiser step and the row (a signal during the snapshot or the
        # checkpoint) logs it before the final checkpoint, so no checkpointed step lacks its row.
        self._unlogged: tuple[int, dict[str, float]] | None = None
        self._row_start = (0.0, time.monotonic())  # the step's wait for its batch, its start
        self.final_checkpoint_failed = False  # a multi-rank learner's ranks must then end at once
        self.counters = dict(self.state.counters)
        for k in ("dropped_batches", "dropped_batch_groups"):
            self.counters.setdefault(k, 0)
        self.ledger = GroupLedger.from_dict(self.state.ledger)
        self.durable: dict[str, int] = self.ledger.prefixes()  # as of the last checkpoint
        self.checkpoints = CheckpointWriter(self.run_dir, keep=cfg.train.keep_checkpoints)
        # Staging buffers for the checkpoints' copy to host (as large as the state), allocated
        # (pinned) before the first step when checkpoints come during the run (periodic, or a
        # leaving producer's); each optimiser step waits for a copy still in flight.
        nbytes, count, cuda = self.trainer.checkpoint_plan()
        if nbytes and (cfg.train.checkpoint_every or cfg.max_producers):
            self.checkpoints.prepare(nbytes, count, pin=cuda)
            self.trainer.state()  # its first call imports for seconds: not in the first stall
        self.trainer.before_update = self.checkpoints.fence
        self._write_s_reported = 0  # background checkpoint writes whose time a row has shown
        # The learner's end of the weight routes: route per producer, GPU copies, captures.
        self.routes = LearnerRoutes(cfg, self.trainer, self.producers, self.counters)
        self._ack_tasks: set[asyncio.Task] = set()
        self._rejects_logged: dict[tuple[str, str], int] = {}
        self._vocab_size = self.trainer.vocab_size
        self._failed_steps = 0  # consecutive training steps that raised
        if resume:  # a checkpoint may hold groups that this run would reject now
            limits = self.limits()
            for g, bad in self.buffer.recheck(lambda g: check_group(g, limits)):
                self._log_rejected(g, bad.reason, f"{bad.detail} (in the resumed checkpoint)")

    # ------------------------------------------------------------------ checks
    def limits(self) -> RunLimits:
        """What a group must fit now (``buffer.checks``); the oldest version kept is
        ``buffer.staleness.oldest_kept``."""
        v = self.state.version
        return RunLimits(group_size=self.cfg.generation.group_size,
                         vocab_size=self._vocab_size,
                         max_tokens=completion_max_tokens(self.cfg),
                         max_model_len=self.cfg.engine.max_model_len,
                         learner_version=v,
                         oldest_version=oldest_kept(v, self.cfg.train.max_staleness,
                                                    self.cfg.sync.keep_snapshots))

    def _log_rejected(self, g: RolloutGroup, reason: str, detail: str) -> None:
        """One line per rejected group, at WARNING for the first few of each (producer, reason)
        so that a flood of them cannot drown the log; every one is counted either way."""
        key = (g.producer_id, reason)
        if key not in self._rejects_logged and len(self._rejects_logged) >= 1000:
            key = ("*", reason)  # producer ids come off the wire: bound the table
        n = self._rejects_logged[key] = self._rejects_logged.get(key, 0) + 1
        level = logging.WARNING if n <= REJECT_LOG_LIMIT else logging.DEBUG
        more = "; further ones of this kind are only counted" if n == REJECT_LOG_LIMIT else ""
        log.log(level, "rejected group %s from producer %s (%s): %s%s", g.group_id,
                g.producer_id, reason, detail, more)

    # ------------------------------------------------------------------ messages
    def _on_group(self, g: RolloutGroup) -> None:
        pid = g.producer_id
        self.state.received[pid] = self.state.received.get(pid, 0) + 1
        cursor = g.metadata.get("cursor")
        if isinstance(cursor, int):
            self.state.cursors[pid] = max(self.state.cursors.get(pid, 0), cursor)

    def _on_hello(self, msg: Hello) -> None:
        new = self.registry.hello(msg)  # a new producer, or a new process of a known one
        info = self.producers.setdefault(msg.producer_id, ProducerInfo())
        if new:  # a new process: its counters start at 0, its predecessor's carry over
            info.carried, info.stats = carry_counters(info.carried, info.stats), {}
        if new and info.pid:
            self.routes.forget(msg.producer_id)  # its link died with the old process
        info.pid = msg.pid
        info.version = msg.policy_version
        info.devices = list(msg.devices)
        info.route = self.routes.choose(msg.producer_id, info.devices)
        if new:  # a repeated Hello (the producer retried, or heard of a restart) says nothing
            log.info("producer %s (pid %d) connected at version %d; weights by %s "
                     "(incarnation %s)", msg.producer_id, msg.pid, msg.policy_version,
                     info.route, msg.incarnation)
        if self.roster.join(msg.producer_id, leaving=msg.leaving):
            log.info("producer %s joined the run: %s", msg.producer_id, self.members)
        elif msg.leaving and msg.producer_id not in self.members:
            self._checkpoint_soon = True  # it left and waits for a checkpoint of its groups
        self.roster.save()

    def _on_control(self, msg: ControlMessage) -> None:
        """A checked control message from a producer (or evaluator) that said Hello."""
        if msg.producer_id in self.evals.ids:
            self.evals.heard(msg.producer_id, msg, self.state.step)
            return
        info = self.producers[msg.producer_id]
        info.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            info.version = msg.policy_version
            info.stats = msg.stats
            self._read[msg.producer_id] = msg.cursor
            if msg.leaving:
                self.roster.mark_leaving(msg.producer_id)
                self.roster.save()
        elif isinstance(msg, SyncReady):
            self.routes.on_sync_ready(msg)
        elif isinstance(msg, EvalResult):
            self.evals.result(msg, self.state.step)
        elif isinstance(msg, Leave):
            was = self.roster.leave(msg.producer_id, msg.cursor)
            self.roster.save()
            if was:
                self._checkpoint_soon = True
                log.info("producer %s left the run after %d groups: %s", msg.producer_id,
                         msg.sent, self.members)
        elif isinstance(msg, Ack):
            self.acks.setdefault(msg.version if msg.ok else -1, {})[msg.producer_id] = msg
            if msg.ok:
                info.version = msg.version
                if msg.timings.get("fallback"):
                    self.counters["transport_fallbacks"] = \
                        self.counters.get("transport_fallbacks", 0) + 1
                    log.warning("producer %s loaded v%d from the snapshot file: %s",
                                msg.producer_id, msg.version, msg.error)
            else:
                self.counters["sync_failures"] = self.counters.get("sync_failures", 0) + 1
                log.error("producer %s failed to sync: %s", msg.producer_id, msg.error)

    def _answer(self, msg: ControlMessage) -> Welcome | Reply:
        """Check and apply one control message; the answer goes back to its sender."""
        if isinstance(msg, Hello):
            reason = self.registry.check_hello(msg)
            if reason is None and msg.producer_id in self.evals.ids:
                self.evals.hello(msg, self.registry.hello(msg))
            elif reason is None:
                self._on_hello(msg)
            if reason is None:
                return Welcome(producer_id=msg.producer_id, incarnation=msg.incarnation,
                               learner_session=self.session)
        else:
            reason = self.registry.check_control(msg.producer_id, msg.incarnation)
            if reason is None:
                self._on_control(msg)
                return Reply(ok=True)
        self.registry.reject(reason, msg.producer_id, type(msg).__name__)
        return Reply(ok=False, reason=reason)

    async def _receive(self) -> None:
        """Data socket -> buffer. It stops reading while the buffer is full (back-pressure up to
        the producers' send); control messages have their own socket and loop."""
        assert self.endpoint is not None
        while True:
            await self.buffer.wait_for_space()
            g = await self.endpoint.recv()
            if g is None:
                self.buffer.note_rejected()
                self.registry.reject(self.endpoint.last_reason, "?", "frame on the data socket")
                continue
            reason = self.registry.check_group(g)
            if reason is not None:
                self.buffer.note_rejected()
                self.registry.reject(reason, g.producer_id, f"group {g.group_id!r}")
                continue
            if not self.ledger.accept(g.metadata["incarnation"], g.metadata["seq"]):
                continue  # a resend of a group we already have (counted in the ledger)
            # After the ledger, so a resent bad group is placed (and counted) once.
            bad = check_group(g, self.limits())
            if bad is not None:
                self.buffer.reject(g, bad.reason)
                self._log_rejected(g, bad.reason, bad.detail)
                continue
            self._on_group(g)
            self.buffer.put(g)

    async def _control(self) -> None:
        """Control socket: every request is answered at once and never waits for the buffer."""
        assert self.endpoint is not None
        while True:
            got = await self.endpoint.recv_control()
            if got is None:
                self.registry.reject("malformed_control", "?", "control frame")
                continue
            peer, rid, msg = got
            await self.endpoint.reply(peer, rid, self._answer(msg))

    def announcement(self, finished: bool = False) -> Announce:
        held = self.buffer.held_by_producer()
        received = dict(self.state.received)
        consumed = {p: n - held.get(p, 0) for p, n in received.items()}
        ref = self.snapshot
        # ``version`` is the newest *file*'s (producers on the file route, catching up or
        # rolling back take it); ``transfer`` offers the newest GPU copy, which may be one
        # ahead while its file is still being written (its "version" key says which).
        version = ref.version if ref else 0
        routes, transfer = self.routes.offer(self.state.version)
        self.roster.top_up(self.state.cursors, self._read)
        self.roster.save()  # before any producer can read a new lease
        return Announce(version=version, snapshot_uri=ref.uri if ref else "",
                        snapshot_checksum=ref.checksum if ref else "",
                        learner_session=self.session, received=received, consumed=consumed,
                        cursors=dict(self.state.cursors), durable=dict(self.durable),
                        accepted={k: st.accepted for k, st in self.ledger.streams.items()},
                        routes=routes, transfer=transfer,
                        heading_to=max(self._heading_to, self.state.version),
                        last_step=self.cfg.train.steps, steps_taken=self._steps_taken,
                        members=list(self.members), leases=self.roster.wire(),
                        finished=finished)

    async def _announce(self) -> None:
        assert self.endpoint is not None
        while True:
            self.routes.maintain()
            self._drop_dead_leavers()
            await self.endpoint.publish(self.announcement())
            await asyncio.sleep(1.0)

    def _drop_dead_leavers(self) -> None:
        """A member that said it was leaving and has been silent for ``ALIVE_S`` (since this
        learner started, for one it knows of from the roster) died before its Leave: the
        launcher will not restart it, so it is taken out, or its share would wait for good.
        What it did not deliver is read by the others (from the cursor of its groups)."""
        now = time.monotonic()
        for pid in sorted(self.roster.leaving & set(self.members)):
            info = self.producers.get(pid)
            heard = max(info.last_seen if info else -ALIVE_S, self._started)
            if now - heard >= ALIVE_S:
                self.roster.leave(pid, self.state.cursors.get(pid, 0))
                self.roster.save()
                self._checkpoint_soon = True
                log.warning("producer %s died while leaving: out of the run: %s", pid,
                            self.members)

    # ------------------------------------------------------------------ snapshots
    async def _on_written(self, ref: SnapshotRef, seconds: float) -> None:
        """A snapshot file is on disk: announce it (producers on the file route take it now)."""
        self.snapshot = ref
        self.last_sync["publish_s"] = seconds
        assert self.endpoint is not None
        await self.endpoint.publish(self.announcement())
        self._track_acks(ref.version)

    def _track_acks(self, version: int) -> None:
        """Start waiting for every producer to reach ``version`` (once per version)."""
        if version > self._acks_tracked:
            self._acks_tracked = version
            task = asyncio.get_running_loop().create_task(
                self._collect_acks(version, time.monotonic()))
            self._ack_tasks.add(task)
            task.add_done_callback(self._ack_tasks.discard)

    async def _collect_acks(self, version: int, published_at: float) -> None:
        """Wait until every live producer runs ``version`` or newer (a producer may skip a
        version it heard of late); report the ones that did not (never block training)."""
        deadline = published_at + self.cfg.sync.ack_timeout_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            alive = [i for p, i in self.producers.items() if i.alive(now) and p in self.members]
            if all(i.version >= version for i in alive):  # none alive: nobody to wait for
                break
            await asyncio.sleep(0.02)
        got = self.acks.pop(version, {})
        now = time.monotonic()
        behind = sorted(p for p, i in self.producers.items()
                        if i.version < version and i.alive(now) and p in self.members)
        if behind:
            log.warning("version %d: no ack from %s within %.0fs; training goes on without "
                        "them", version, behind, self.cfg.sync.ack_timeout_s)
        if got:
            timings = [a.timings for a in got.values()]
            self.last_sync |= {
                "sync_s": time.monotonic() - published_at,
                "swap_idle_s": max(t.get("idle_s", 0.0) for t in timings),
                "swap_drain_s": max(t.get("drain_s", 0.0) for t in timings),
                # What a long drain waited for: started prefills, and requests restarted.
                "swap_drain_waited": max(t.get("drain_waited", 0.0) for t in timings),
                "swap_drain_resubmitted": max(t.get("drain_resubmitted", 0.0) for t in timings),
                "swap_load_s": max(t.get("load_s", 0.0) for t in timings),
                "swap_stream_s": max(t.get("prepare_stream_s", 0.0) for t in timings),
                "stream_bytes": sum(t.get("prepare_stream_bytes", 0.0) for t in timings),
                "producers_acked": float(len(got)),
            }

    # ------------------------------------------------------------------ training
    async def _train(self) -> None:
        t = self.cfg.train
        st = self.state
        last_end = time.monotonic()
        while st.step < t.steps:
            t0 = time.monotonic()
            try:
                batch = await self.buffer.get_batch(t.batch_groups, st.version,
                                                    timeout=t.batch_timeout_s)
            except TimeoutError as e:
                alive = [p for p, i in self.producers.items()
                         if i.alive(time.monotonic())]
                raise TimeoutError(f"no batch of {t.batch_groups} groups within "
                                   f"{t.batch_timeout_s:.0f}s (producers alive: {alive or 'none'}"
                                   f"): {e}") from None
            wait_s = time.monotonic() - t0
            self._row_start = (wait_s, last_end)  # for the row of a step a stop interrupts
            m = await self._step_to_its_end(batch)
            if m is None:
                continue
            if m["skipped_nonfinite"]:
                self.counters["skipped_nonfinite"] = self.counters.get("skipped_nonfinite", 0) + 1
                log.error("step %d: non-finite loss or gradient; update skipped, no snapshot",
                          st.step)
            elif st.step % self.cfg.sync.sync_every == 0 and st.step < t.steps:
                t1 = time.monotonic()
                flat, layout = await asyncio.to_thread(self.routes.capture, st.version + 1)
                m["snapshot_copy_s"] = time.monotonic() - t1
                m["snapshot_buckets"] = float(self.routes.capture_buckets)
                st.version += 1
                self.writer.submit(st.version, flat, layout)
                del flat
                if self.routes.on_gpu(st.version):
                    # GPU-route producers take it now, before (and whatever) the file.
                    await self.endpoint.publish(self.announcement())
                    self._track_acks(st.version)
            now = time.monotonic()
            m.update(self._row_figures(m, wait_s, now - last_end, now))
            last_end = now
            if st.first_reward is None:
                st.first_reward = m["reward_mean"]
            ce = t.checkpoint_every
            soon, self._checkpoint_soon = self._checkpoint_soon, False
            if ce or soon:  # the stall lands in the next step's step_s, as the snapshot copy's
                stall = await self.checkpoint() \
                    if (soon or st.step % ce == 0) and st.step < t.steps else 0.0
                if stall is None:  # skipped: a write is in flight; a leaver's retried next step
                    self._checkpoint_soon = soon
                m["checkpoint_stall_s"] = stall or 0.0
                if stall:
                    m.update(self.checkpoints.stall_parts)
                    self.checkpoints.stall_parts = {}
            self._checkpoint_failed()
            m.update(self._take_checkpoint_write())
            self.metrics.log(st.step, m)
            self._unlogged = None
        await self.evals.await_last(st.version)
        await self.writer.flush()  # a failed write raises here, not silently

    def _row_figures(self, m: dict[str, float], wait_s: float, step_s: float, now: float
                     ) -> dict[str, float]:
        """What a step's metrics row adds to the trainer's figures ``m``: times, the buffer's
        and the producers' counters, the learner's counters, sync timings."""
        t, bs = self.cfg.train, self.buffer.stats
        return {
            "version": float(self.state.version), "wait_s": wait_s, "step_s": step_s,
            "tokens_per_s": m["trained_tokens"] / max(step_s, 1e-9),
            "samples_per_s": t.batch_groups * self.cfg.generation.group_size / max(step_s, 1e-9),
            "buffer_size": float(len(self.buffer)), "dropped_stale": float(bs.dropped_stale),
            "rejected_frames": float(bs.rejected), "received": float(bs.received),
            "rejected_groups": float(sum(bs.rejected_groups.values())),
            **{f"rejected_groups/{k}": float(v) for k, v in bs.rejected_groups.items()},
            "producers_alive": float(sum(1 for i in self.producers.values() if i.alive(now))),
            "producers_members": float(len(self.members)),
            **self._producer_metrics(),
            **self.evals.step_metrics(),
            **{k: float(v) for k, v in self.counters.items()},
            "snapshot_files_skipped": float(self.writer.skipped),
            "duplicates_ignored": float(self.ledger.duplicates),
            **self.registry.metrics(),
            **self._take_sync(),
        }

    def _producer_metrics(self) -> dict[str, float]:
        """Every producer counter (from heartbeats, restarts carried over), per producer and
        summed; ``gen_tokens_per_s``: the producers' tokens per second of generation."""
        m = producer_metrics({p: {**i.stats, **carry_counters(i.carried, i.stats)}
                              for p, i in self.producers.items()})
        m["gen_tokens_per_s"] = m.pop("producer/gen_tokens_per_s", 0.0)
        return m

    async def _step_to_its_end(self, batch: list[RolloutGroup]) -> dict[str, float] | None:
        """Train ``batch`` (``_step``). A stop (Ctrl-C, SIGTERM: this task cancelled) that lands
        meanwhile waits for the step to end and be counted, then goes on: a batch taken from
        the buffer is never lost between the buffer and the final checkpoint, and that
        checkpoint never copies weights an optimiser step is still updating."""
        step = asyncio.ensure_future(self._step(batch))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            await step
            raise

    async def _step(self, batch: list[RolloutGroup]) -> dict[str, float] | None:
        """One step on a batch that has left the buffer, counted in the state (and its row
        pending in ``_unlogged``); None when the batch was dropped (``_train_batch``)."""
        st, t = self.state, self.cfg.train
        self._steps_taken = st.step + 1  # the batch left the buffer: no more groups for it
        if (st.step + 1) % self.cfg.sync.sync_every == 0 and st.step + 1 < t.steps:
            # This step publishes v+1: producers still on v stop starting groups (they would
            # be too stale), and learn it together with the batch's consumption.
            self._heading_to = st.version + 1
            await self.endpoint.publish(self.announcement())
        m = await self._train_batch(batch, st.version)
        if m is None or m["skipped_nonfinite"]:
            self._heading_to = st.version
        if m is None:
            self._steps_taken = st.step  # the batch was dropped: its step needs another
            return None
        st.step += 1
        self._unlogged = (st.step, m)
        return m

    async def _train_batch(self, batch: list[RolloutGroup], version: int
                           ) -> dict[str, float] | None:
        """One optimiser step on ``batch``, or None if the step raised: the batch is dropped
        (counted, logged with its group ids) and training goes on, as data must never stop
        the learner. Only a trainer that fails MAX_FAILED_STEPS batches in a row stops it."""
        try:
            m = await asyncio.to_thread(self.trainer.step, batch, version)
        except Exception as e:
            self._failed_steps += 1
            self.counters["dropped_batches"] = self.counters.get("dropped_batches", 0) + 1
            self.counters["dropped_batch_groups"] = \
                self.counters.get("dropped_batch_groups", 0) + len(batch)
            log.error("training step raised %s: %s; dropped the batch of groups %s (producers "
                      "%s), training goes on", type(e).__name__, e,
                      [g.group_id for g in batch], sorted({g.producer_id for g in batch}))
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(f"{self._failed_steps} training steps in a row raised; "
                                   f"the last: {type(e).__name__}: {e}") from e
            return None
        self._failed_steps = 0
        return m

    def _take_sync(self) -> dict[str, float]:
        """Sync timings that arrived since the last step's row, each reported once: repeating a
        stale one in later rows would skew the per-step means (the GPU benchmark averages them)."""
        out, self.last_sync = self.last_sync, {}
        return out

    async def checkpoint(self, final: bool = False) -> float | None:
        """Save a checkpoint; returns the seconds training was stopped for it, or None if it
        was skipped (the previous one is still being written: ``checkpoints_skipped``).

        Training stops only while the copy of the trainer's state to host memory is started;
        the copy overlaps the next step up to its optimiser step, and the write runs in the
        background (``CheckpointWriter``). Under DeepSpeed the ranks write their partitions
        before this returns. ``durable`` advances only once the write is complete. ``final``:
        the process exits next, so wait for a write in flight first and for this one after."""
        if final:
            await self.checkpoints.wait()
            self._checkpoint_failed(final=True)
        self.state.counters = dict(self.counters)
        self.state.ledger = self.ledger.to_dict()
        # Buffer and ledger are captured together, before any await, so they agree exactly;
        # the state is a copy, as the background write reads it while training goes on.
        prefixes = self.ledger.prefixes()
        state = copy.deepcopy(self.state)
        buf = self.buffer.snapshot()

        def durable(path: Path) -> None:
            self.durable = prefixes  # producers may now forget these groups
            log.info("checkpoint saved: %s", path)

        shards = self.trainer.save_shards if self.trainer.has_shards else None
        stall = await self.checkpoints.save(state, self.trainer.state, buf, durable,
                                            shards=shards)
        if final:
            await self.checkpoints.wait()
        return stall

    def _checkpoint_failed(self, final: bool = False) -> None:
        """A failed checkpoint write in one line (its partial directory is gone and the
        previous checkpoint kept, ``save_checkpoint``); with train.on_checkpoint_error stop (and
        not at the end, when the final checkpoint is still to be tried) it stops the learner."""
        e = self.checkpoints.take_error()
        if e is None:
            return
        if self.cfg.train.on_checkpoint_error == "stop" and not final:
            log.error("%s; stopping the learner (train.on_checkpoint_error: stop)", e)
            raise e
        log.error("%s; training goes on (train.on_checkpoint_error: continue)", e)

    def _take_checkpoint_write(self) -> dict[str, float]:
        """Checkpoint counters and free disk; ``checkpoint_write_s`` (and its GB/s) of a
        write completed since the last row, reported once."""
        c = self.checkpoints
        m = {"checkpoints_skipped": float(c.skipped), "checkpoint_failures": float(c.failures),
             "checkpoint_disk_free_gb": disk_free(self.run_dir / "checkpoints") / 1e9}
        if c.completed == self._write_s_reported or c.write_s is None:
            return m
        self._write_s_reported = c.completed
        m["checkpoint_write_s"] = c.write_s
        if c.write_bytes:
            m["checkpoint_write_gbps"] = c.write_bytes / 1e9 / max(c.write_s, 1e-9)
        return m

    async def _final_checkpoint(self) -> None:
        """The checkpoint at the end (or stop) of the run, written before the process exits;
        its times in one console line (no metrics row of its own; a step stopped before its row
        gets that row first)."""
        t0 = time.monotonic()
        c = self.checkpoints
        if self._unlogged is not None:  # stopped mid-step: the checkpoint holds this step
            step, m = self._unlogged
            self._unlogged = None
            wait_s, since = self._row_start
            now = time.monotonic()
            if "version" not in m:  # the stop landed before the row's figures were added
                m.update(self._row_figures(m, wait_s, now - since, now))
            m.update(self._take_checkpoint_write())
            self.metrics.log(step, {**m, "interrupted": 1.0}, progress=False)
        try:
            stall = await self.checkpoint(final=True)
        except Exception as e:
            self.final_checkpoint_failed = True
            log.error("final checkpoint at step %d failed: %s", self.state.step, e)
            return
        error = c.take_error()
        if error is not None:
            self.final_checkpoint_failed = True
            log.error("final checkpoint failed: %s", error)
            return
        total = time.monotonic() - t0
        print(f"final checkpoint {c.written}: {total:.1f} s ({stall or 0.0:.1f} s starting the "
              f"copy, {c.write_s or 0.0:.1f} s writing)", file=ConsoleStream(), flush=True)

    async def run(self) -> None:
        log.info("learner pid %d, session %s, step %d, version %d", os.getpid(), self.session,
                 self.state.step, self.state.version)
        self.routes.start()
        # The writer's pinned buffer now, not at the first version: allocating page-locked
        # memory holds the CUDA driver, which would stall the first checkpoint's copy.
        self.writer.prepare(self.routes.device_capture_bytes())
        # Restarted from an older checkpoint: the dead learner's newer files are gone weights.
        drop_newer(self.snapshot_dir, self.state.version)
        if self.state.version > 0:  # resumed: producers must load this version first
            flat, layout = await asyncio.to_thread(self.routes.capture, self.state.version)
            self.snapshot = await self.writer.write_now(self.state.version, flat, layout)
            del flat
        self.endpoint = LearnerEndpoint(self.cfg.bind_addr, insecure=self.cfg.insecure,
                                        curve=curve_keys(self.cfg, "learner"))
        server = serve_stream(self.cfg, self.snapshot_dir)
        finished = False
        try:
            async with asyncio.TaskGroup() as tg:
                background = [tg.create_task(self._receive()), tg.create_task(self._control()),
                              tg.create_task(self._announce()), tg.create_task(self.writer.run())]
                await self._train()
                finished = True
                for task in background:
                    task.cancel()
        finally:
            with contextlib.suppress(Exception):
                self.routes.release_host_memory()
            with contextlib.suppress(Exception):
                await asyncio.shield(self._final_checkpoint())
            if finished:  # producers of other launchers (--role producer) exit on this
                with contextlib.suppress(Exception):
                    await self.endpoint.publish(self.announcement(finished=True))
            self.endpoint.close()  # LINGER flushes that last announce
            if server is not None:
                server.close()
            self.metrics.close()
            self.routes.close()
            if not self.cfg.sync.snapshot_dir:
                shutil.rmtree(self.snapshot_dir, ignore_errors=True)
            if finished:
                self.summary()

    def summary(self) -> None:
        from pipeline.learner.metrics import read_metrics

        path = self.run_dir / "metrics.jsonl"
        rows = [r for r in read_metrics(path) if "reward_mean" in r]
        if not rows:
            return
        png = plot_run(path, self.run_dir / "reward.png")
        k = max(1, min(5, len(rows) // 4))
        first = sum(r["reward_mean"] for r in rows[:k]) / k
        last = sum(r["reward_mean"] for r in rows[-k:]) / k
        print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
              f"({len(rows)} steps, {rows[-1]['time'] / 60:.1f} min)\nplot: {png}\n"
              f"metrics: {path}\nlogs: {self.run_dir / LOGS_DIR}", file=ConsoleStream())
