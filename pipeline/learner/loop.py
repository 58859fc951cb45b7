"""The learner process: receives groups into the rollout buffer, trains, publishes snapshots.

Four coroutines under one TaskGroup: ``_receive`` (data socket -> buffer, waiting while the
buffer is full), the control channel's ``serve`` and ``announce`` (``pipeline.learner.control``:
every request answered at once, whatever the buffer does; the current version re-broadcast every
second), and ``_train``, one step after another in stages: batch (from the buffer, within the
staleness limit) -> step (the optimiser step in a worker thread, counted) -> publish (a snapshot
of the new version on every weight route) -> checkpoint (when due) -> log (the step's metrics
row, built by ``pipeline.learner.step_metrics``). Sync mode is the same loop with max_staleness 0
and admission budgets of exactly one batch: generate with v, train on that batch, publish v+1.

Groups from producers that have not said Hello are refused and counted (``buffer.identity``);
a group is accepted once (the ledger: resends after a producer or learner restart are dropped)
and checked against the run's limits (``buffer.checks``) before the buffer takes it.

Weights: every version is packed once and written as a snapshot file; producers whose route
(picked per producer from the GPUs in its Hello) has a GPU copy also get it from the packed
buffer. What is published on each route is ``pipeline.learner.routes``'s; this loop says when.
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
from dataclasses import dataclass
from pathlib import Path

from buffer.checks import RunLimits, check_group
from buffer.ledger import GroupLedger
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
from pipeline.learner.control import Control
from pipeline.learner.disk import disk_free
from pipeline.learner.evaluation import Evaluations
from pipeline.learner.metrics import MetricsLogger, plot_run
from pipeline.learner.oom import MemoryFloorError
from pipeline.learner.producers import ProducerInfo
from pipeline.learner.roster import Roster
from pipeline.learner.routes import LearnerRoutes, serve_stream, snapshot_dir
from pipeline.learner.step_metrics import step_row
from pipeline.learner.trackers import Trackers
from pipeline.learner.trainer import PolicyTrainer
from pipeline.options import to_dict
from pipeline.procs import LOGS_DIR, ConsoleStream
from sync.snapshot import SnapshotRef, drop_newer
from sync.writer import SnapshotWriter

log = logging.getLogger(__name__)
REJECT_LOG_LIMIT = 20  # warning lines per (producer, reason); later ones only count (DEBUG)
MAX_FAILED_STEPS = 10  # training steps raising in a row: the trainer is broken, not the data


@dataclass
class PendingRow:
    """A counted step's metrics row until it is logged. A stop between the optimiser step and
    the row (a signal during the snapshot or the checkpoint) logs it before the final
    checkpoint, so no checkpointed step lacks its row."""

    step: int
    figures: dict[str, float]  # the trainer's; the learner's are added by ``Learner._complete``
    wait_s: float  # the step's wait for its batch
    since: float  # when the previous step ended (monotonic)
    complete: bool = False  # the learner's figures are in ``figures``


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
        self.writer = SnapshotWriter(self.snapshot_dir, cfg.sync.keep_snapshots,
                                     on_written=self._on_written)
        self.endpoint: LearnerEndpoint | None = None
        self.metrics = MetricsLogger(self.run_dir, tensorboard="tensorboard" in cfg.report_to,
                                     progress=cfg.progress, total_steps=cfg.train.steps,
                                     trackers=Trackers(cfg.report_to, self.run_dir, cfg.name,
                                                       to_dict(cfg)),
                                     stream=ConsoleStream())
        # Evaluation figures, and the dedicated evaluator (eval.producer), never a producer.
        self.evals = Evaluations(cfg, self.metrics)
        self._unlogged: PendingRow | None = None
        # A step's update that makes a version (``_publish``) but has not been given one yet:
        # a stop between the two lands here, and the final checkpoint gives it its number.
        self._owes_version = False
        self.final_checkpoint_failed = False  # a multi-rank learner's ranks must then end at once
        self.counters = dict(self.state.counters)
        for k in ("dropped_batches", "dropped_batch_groups"):
            self.counters.setdefault(k, 0)
        self.ledger = GroupLedger.from_dict(self.state.ledger)
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
        producers: dict[str, ProducerInfo] = {}
        self.routes = LearnerRoutes(cfg, self.trainer, producers, self.counters)
        # The control channel: producers, their messages, the announcements.
        t = cfg.train
        roster = Roster.open(self.run_dir, cfg.num_producers,
                             chunk=max(2 * (t.max_staleness + 1) * t.batch_groups, 8))
        self.control = Control(cfg, self.session, self.state, self.buffer, self.ledger,
                               self.routes, producers, self.evals, self.counters, roster)
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

    # ------------------------------------------------------------------ data
    def _on_group(self, g: RolloutGroup) -> None:
        pid = g.producer_id
        self.state.received[pid] = self.state.received.get(pid, 0) + 1
        cursor = g.metadata.get("cursor")
        if isinstance(cursor, int):
            self.state.cursors[pid] = max(self.state.cursors.get(pid, 0), cursor)

    async def _receive(self) -> None:
        """Data socket -> buffer. It stops reading while the buffer is full (back-pressure up to
        the producers' send); control messages have their own socket and loop."""
        assert self.endpoint is not None
        while True:
            await self.buffer.wait_for_space()
            g = await self.endpoint.recv()
            if g is None:
                self.buffer.note_rejected()
                self.control.registry.reject(self.endpoint.last_reason, "?",
                                             "frame on the data socket")
                continue
            reason = self.control.registry.check_group(g)
            if reason is not None:
                self.buffer.note_rejected()
                self.control.registry.reject(reason, g.producer_id, f"group {g.group_id!r}")
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

    # ------------------------------------------------------------------ snapshots
    async def _on_written(self, ref: SnapshotRef, seconds: float) -> None:
        """A snapshot file is on disk: announce it (producers on the file route take it now)."""
        self.control.snapshot = ref
        self.control.last_sync["publish_s"] = seconds
        await self.control.publish()
        self.control.track_acks(ref.version)

    # ------------------------------------------------------------------ training
    async def _train(self) -> None:
        """Step after step until ``train.steps``: batch -> step -> publish -> checkpoint -> log."""
        st = self.state
        last_end = time.monotonic()
        while st.step < self.cfg.train.steps:
            batch, wait_s = await self._next_batch()
            row = await self._step_to_its_end(batch, wait_s, last_end)
            if row is None:  # the batch was dropped
                continue
            await self._publish(row.figures)
            last_end = time.monotonic()
            self._complete(row, last_end)
            await self._checkpoint_if_due(row.figures)
            self._log(row)
        await self.evals.await_last(st.version)
        await self.writer.flush()  # a failed write raises here, not silently

    async def _next_batch(self) -> tuple[list[RolloutGroup], float]:
        """The next batch from the buffer (within the staleness limit) and the wait for it."""
        t = self.cfg.train
        t0 = time.monotonic()
        try:
            batch = await self.buffer.get_batch(t.batch_groups, self.state.version,
                                                timeout=t.batch_timeout_s)
        except TimeoutError as e:
            alive = self.control.alive(time.monotonic())
            raise TimeoutError(f"no batch of {t.batch_groups} groups within "
                               f"{t.batch_timeout_s:.0f}s (producers alive: {alive or 'none'}"
                               f"): {e}") from None
        return batch, time.monotonic() - t0

    async def _step_to_its_end(self, batch: list[RolloutGroup], wait_s: float, since: float
                               ) -> PendingRow | None:
        """Train ``batch`` (``_step``). A stop (Ctrl-C, SIGTERM: this task cancelled) that lands
        meanwhile waits for the step to end and be counted, then goes on: a batch taken from
        the buffer is never lost between the buffer and the final checkpoint, and that
        checkpoint never copies weights an optimiser step is still updating."""
        step = asyncio.ensure_future(self._step(batch, wait_s, since))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            await step
            raise

    async def _step(self, batch: list[RolloutGroup], wait_s: float, since: float
                    ) -> PendingRow | None:
        """One step on a batch that has left the buffer, counted in the state, its row pending
        in ``_unlogged``; None when the batch was dropped (``_train_batch``)."""
        st, t, c = self.state, self.cfg.train, self.control
        c.steps_taken = st.step + 1  # the batch left the buffer: no more groups for it
        if (st.step + 1) % self.cfg.sync.sync_every == 0 and st.step + 1 < t.steps:
            # This step publishes v+1: producers still on v stop starting groups (they would
            # be too stale), and learn it together with the batch's consumption.
            c.heading_to = st.version + 1
            await c.publish()
        m = await self._train_batch(batch, st.version)
        if m is None or m["skipped_nonfinite"]:
            c.heading_to = st.version
        if m is None:
            c.steps_taken = st.step  # the batch was dropped: its step needs another
            return None
        st.step += 1
        self._owes_version = not m["skipped_nonfinite"] and \
            st.step % self.cfg.sync.sync_every == 0 and st.step < t.steps
        if st.first_reward is None:
            st.first_reward = m["reward_mean"]
        self._unlogged = PendingRow(st.step, m, wait_s, since)
        return self._unlogged

    async def _publish(self, m: dict[str, float]) -> None:
        """The new version, when this step makes one: captured (packed on the model's device),
        offered at once to GPU-route producers, its snapshot file written in the background. A
        step whose update was skipped (non-finite) publishes nothing."""
        st, t = self.state, self.cfg.train
        if m["skipped_nonfinite"]:
            self.counters["skipped_nonfinite"] = self.counters.get("skipped_nonfinite", 0) + 1
            log.error("step %d: non-finite loss or gradient; update skipped, no snapshot",
                      st.step)
            return
        if st.step % self.cfg.sync.sync_every != 0 or st.step >= t.steps:
            return
        t1 = time.monotonic()
        flat, layout = await asyncio.to_thread(self.routes.capture, st.version + 1)
        m["snapshot_copy_s"] = time.monotonic() - t1
        m["snapshot_buckets"] = float(self.routes.capture_buckets)
        st.version += 1
        self._owes_version = False
        self.writer.submit(st.version, flat, layout)
        del flat
        if self.routes.on_gpu(st.version):
            # GPU-route producers take it now, before (and whatever) the file.
            await self.control.publish()
            self.control.track_acks(st.version)

    def _complete(self, row: PendingRow, now: float) -> None:
        """Add the learner's figures (``step_metrics.step_row``) to a step's row, once."""
        if row.complete:
            return
        row.complete = True
        c, bs = self.control, self.buffer.stats
        counters = {**self.counters, "snapshot_files_skipped": self.writer.skipped,
                    "duplicates_ignored": self.ledger.duplicates}
        row.figures.update(step_row(
            row.figures, version=self.state.version, wait_s=row.wait_s, step_s=now - row.since,
            samples=self.cfg.train.batch_groups * self.cfg.generation.group_size,
            buffer_size=len(self.buffer), buffer_stats=bs, producers=c.figures(now),
            counters=counters))

    async def _checkpoint_if_due(self, m: dict[str, float]) -> None:
        """A checkpoint every ``train.checkpoint_every`` steps, or soon after a producer left
        (its groups must be durable before it exits); its stall lands in this step's row, and
        in the next step's step_s, as the snapshot copy's does."""
        st, t, c = self.state, self.cfg.train, self.control
        ce = t.checkpoint_every
        soon, c.checkpoint_soon = c.checkpoint_soon, False
        if ce or soon:
            stall = await self.checkpoint() \
                if (soon or st.step % ce == 0) and st.step < t.steps else 0.0
            if stall is None:  # skipped: a write is in flight; a leaver's retried next step
                c.checkpoint_soon = soon
            m["checkpoint_stall_s"] = stall or 0.0
            if stall:
                m.update(self.checkpoints.stall_parts)
                self.checkpoints.stall_parts = {}
        self._checkpoint_failed()

    def _log(self, row: PendingRow, interrupted: bool = False) -> None:
        """The step's metrics row, with the checkpoint figures since the last row."""
        row.figures.update(self._take_checkpoint_write())
        if interrupted:
            self.metrics.log(row.step, {**row.figures, "interrupted": 1.0}, progress=False)
        else:
            self.metrics.log(row.step, row.figures)
        self._unlogged = None

    async def _train_batch(self, batch: list[RolloutGroup], version: int
                           ) -> dict[str, float] | None:
        """One optimiser step on ``batch``, or None if the step raised: the batch is dropped
        (counted, logged with its group ids) and training goes on, as data must never stop
        the learner. Only a trainer that fails MAX_FAILED_STEPS batches in a row stops it."""
        try:
            m = await asyncio.to_thread(self.trainer.step, batch, version)
        except MemoryFloorError as e:  # nothing smaller to retry: the learner stops
            log.error("%s", e)  # its one line; the entry exits 1 without a traceback
            raise
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
        if self._owes_version:
            # Stopped between a step's update and its version (the final checkpoint): the
            # weights saved are that version's, so the checkpoint says so, and a resumed
            # learner publishes them under it. Under the old number, producers still holding
            # it would keep the older weights and their groups would be counted one version
            # fresher than they are (in sync mode: off-policy data taken for on-policy).
            state.version += 1
        buf = self.buffer.snapshot()

        def durable(path: Path) -> None:
            self.control.durable = prefixes  # producers may now forget these groups
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
            row = self._unlogged
            self._complete(row, time.monotonic())
            self._log(row, interrupted=True)
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
            self.control.snapshot = await self.writer.write_now(self.state.version, flat,
                                                                layout)
            del flat
        self.endpoint = LearnerEndpoint(self.cfg.bind_addr, insecure=self.cfg.insecure,
                                        curve=curve_keys(self.cfg, "learner"))
        self.control.endpoint = self.endpoint
        server = serve_stream(self.cfg, self.snapshot_dir)
        finished = False
        try:
            async with asyncio.TaskGroup() as tg:
                background = [tg.create_task(self._receive()),
                              tg.create_task(self.control.serve()),
                              tg.create_task(self.control.announce()),
                              tg.create_task(self.writer.run())]
                await self._train()
                finished = True
                for task in background:
                    task.cancel()
        finally:
            try:
                with contextlib.suppress(Exception):
                    self.routes.release_host_memory()
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._final_checkpoint())
                if finished:  # producers of other launchers (--role producer) exit on this
                    with contextlib.suppress(Exception):
                        await self.control.publish(finished=True)
            finally:  # whatever the above raised (a second stop lands as a CancelledError)
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
