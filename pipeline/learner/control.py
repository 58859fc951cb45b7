"""The learner's side of the control channel: who the producers are, what they tell the learner
and what it tells them.

Producers are known by their Hello (``buffer.identity``): control messages from a producer that
has not said Hello, or from an incarnation it did not declare, are refused and counted as
``rejected/<reason>``; only producers heard from lately count as alive. Every request is answered
at once (``answer``), whatever the buffer or training does: Hello (route chosen per producer
from its GPUs, joins), Heartbeat (counters, data cursor, leaving), SyncReady (the weight routes'),
EvalResult (the evaluation figures'), Leave (the roster's) and Ack (a producer runs a version).

The Announce (``announcement``) tells every producer the newest version and where to get it,
what the learner has received and consumed of each (admission), what is durable (in a
checkpoint), the run's members and data leases. It is re-broadcast every second (``announce``)
so producers that (re)connect catch up before they generate, and published at once when a
version or a step's consumption changes. The learner's loop sets what only it knows (``snapshot``,
``durable``, ``heading_to``, ``steps_taken``) and reads back ``checkpoint_soon`` (a producer left
and waits for a checkpoint of its groups) and the sync timings (``take_sync``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

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
from buffer.store import RolloutBuffer
from buffer.transport import LearnerEndpoint
from pipeline.appendfile import DiskFull, is_disk_full
from pipeline.config import RunConfig
from pipeline.learner.checkpoint import LearnerState
from pipeline.learner.evaluation import Evaluations
from pipeline.learner.metrics import carry_counters, producer_metrics
from pipeline.learner.producers import ALIVE_S, ProducerInfo
from pipeline.learner.roster import Roster
from pipeline.learner.routes import LearnerRoutes
from pipeline.procs import dropped_lines
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)


class Control:
    def __init__(self, cfg: RunConfig, session: str, state: LearnerState, buffer: RolloutBuffer,
                 ledger: GroupLedger, routes: LearnerRoutes, producers: dict[str, ProducerInfo],
                 evals: Evaluations, counters: dict[str, Any], roster: Roster):
        self.cfg, self.session, self.state = cfg, session, state
        self.buffer, self.ledger, self.routes, self.evals = buffer, ledger, routes, evals
        self.counters = counters
        self.producers = producers
        self.registry = ProducerRegistry({f"p{i}" for i in range(cfg.producer_slots)},
                                         evaluators=evals.ids)
        # Who shares the admission budget now, who is leaving, and who may read which prompts
        # (elastic runs: max_producers); on file, so a restarted learner keeps them.
        self.roster = roster
        self.members = roster.members
        self.endpoint: LearnerEndpoint | None = None
        self.snapshot: SnapshotRef | None = None  # the newest snapshot file written
        self.durable: dict[str, int] = ledger.prefixes()  # as of the last checkpoint
        self.heading_to = 0  # version the step under way will publish (Announce.heading_to)
        self.steps_taken = state.step  # batches taken (Announce.steps_taken)
        self.checkpoint_soon = False  # a producer left: its groups go in the next checkpoint
        self.acks: dict[int, dict[str, Ack]] = {}
        self.last_sync: dict[str, float] = {}
        self._acks_tracked = 0  # newest version whose acks are being collected
        self._ack_tasks: set[asyncio.Task] = set()
        self._read: dict[str, int] = {}  # data cursor per producer, from its heartbeats
        # When this learner began to answer (``serve``): the grace of a member it knows as
        # leaving only from the roster starts then, not at a start slowed by a big snapshot.
        self._started: float | None = None
        self._roster_unsaved = False  # run_dir's disk had no room for the roster's last change

    # ------------------------------------------------------------------ requests
    def answer(self, msg: ControlMessage) -> Welcome | Reply:
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

    async def serve(self) -> None:
        """Control socket: every request is answered at once and never waits for the buffer."""
        assert self.endpoint is not None
        if self._started is None:
            self._started = time.monotonic()
        while True:
            got = await self.endpoint.recv_control()
            if got is None:
                self.registry.reject("malformed_control", "?", "control frame")
                continue
            peer, rid, msg = got
            await self.endpoint.reply(peer, rid, self.answer(msg))

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
            self.checkpoint_soon = True  # it left and waits for a checkpoint of its groups
        self._save_roster()

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
                self._save_roster()
        elif isinstance(msg, SyncReady):
            self.routes.on_sync_ready(msg)
        elif isinstance(msg, EvalResult):
            self.evals.result(msg, self.state.step)
        elif isinstance(msg, Leave):
            was = self.roster.leave(msg.producer_id, msg.cursor)
            self._save_roster()
            if was:
                self.checkpoint_soon = True
                log.info("producer %s left the run after %d groups: %s", msg.producer_id,
                         msg.sent, self.members)
        elif isinstance(msg, Ack):
            self._on_ack(msg, info)

    def _on_ack(self, msg: Ack, info: ProducerInfo) -> None:
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

    def alive(self, now: float) -> list[str]:
        """The producers heard from within ``ALIVE_S``."""
        return [p for p, i in self.producers.items() if i.alive(now)]

    def figures(self, now: float) -> dict[str, float]:
        """What a step's metrics row reports of the producers: how many are alive and members,
        every producer counter (from heartbeats, restarts carried over) per producer and
        summed (``gen_tokens_per_s``: their tokens per second of generation), the evaluation
        figures, refused messages, and the sync timings since the last row."""
        m = producer_metrics({p: {**i.stats, **carry_counters(i.carried, i.stats)}
                              for p, i in self.producers.items()})
        m["gen_tokens_per_s"] = m.pop("producer/gen_tokens_per_s", 0.0)
        if dropped := dropped_lines():  # this process's lines its full disk refused
            m["learner/log_lines_dropped"] = float(dropped)
        return {"producers_alive": float(len(self.alive(now))),
                "producers_members": float(len(self.members)),
                **m, **self.evals.step_metrics(), **self.registry.metrics(), **self.take_sync()}

    # ------------------------------------------------------------------ announcements
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
        if not self._save_roster():  # before any producer can read a new lease
            raise DiskFull(errno.ENOSPC, "the roster cannot be saved: run_dir's disk is full")
        return Announce(version=version, snapshot_uri=ref.uri if ref else "",
                        snapshot_checksum=ref.checksum if ref else "",
                        learner_session=self.session, received=received, consumed=consumed,
                        cursors=dict(self.state.cursors), durable=dict(self.durable),
                        accepted={k: st.accepted for k, st in self.ledger.streams.items()},
                        routes=routes, transfer=transfer,
                        heading_to=max(self.heading_to, self.state.version),
                        last_step=self.cfg.train.steps, steps_taken=self.steps_taken,
                        members=list(self.members), leases=self.roster.wire(),
                        finished=finished)

    async def publish(self, finished: bool = False) -> None:
        """Broadcast the announcement now; none while the roster it would name cannot be saved
        (run_dir's disk is full): producers go on with the last one until there is room."""
        assert self.endpoint is not None
        try:
            ann = self.announcement(finished)
        except DiskFull:
            return
        await self.endpoint.publish(ann)

    def _save_roster(self) -> bool:
        """Save the roster if it changed; False while run_dir's disk has no room for it (it
        stays changed, saved at the next chance, and no announce names the change before)."""
        try:
            self.roster.save()
        except OSError as e:
            if not is_disk_full(e):
                raise
            if not self._roster_unsaved:
                log.info("the roster cannot be saved (run_dir's disk is full): announcements "
                         "wait until it can")
            self._roster_unsaved = True
            return False
        self._roster_unsaved = False
        return True

    async def announce(self) -> None:
        """Re-broadcast every second; keep NCCL links offered; drop members that died leaving."""
        while True:
            self.routes.maintain()
            self._drop_dead_leavers()
            await self.publish()
            await asyncio.sleep(1.0)

    def _drop_dead_leavers(self) -> None:
        """A member that said it was leaving and has been silent for ``ALIVE_S`` (since this
        learner began to answer, for one it knows of from the roster) died before its Leave: the
        launcher will not restart it, so it is taken out, or its share would wait for good.
        What it did not deliver is read by the others (from the cursor of its groups). Before
        the learner answers (``serve``) nobody could have been heard: nobody is taken out."""
        if self._started is None:
            return
        now = time.monotonic()
        for pid in sorted(self.roster.leaving & set(self.members)):
            info = self.producers.get(pid)
            heard = max(info.last_seen if info else -ALIVE_S, self._started)
            if now - heard >= ALIVE_S:
                self.roster.leave(pid, self.state.cursors.get(pid, 0))
                self._save_roster()
                self.checkpoint_soon = True
                log.warning("producer %s died while leaving: out of the run: %s", pid,
                            self.members)

    # ------------------------------------------------------------------ acks
    def track_acks(self, version: int) -> None:
        """Start waiting for every producer to reach ``version`` (once per version)."""
        if version > self._acks_tracked:
            self._acks_tracked = version
            task = asyncio.get_running_loop().create_task(
                self.collect_acks(version, time.monotonic()))
            self._ack_tasks.add(task)
            task.add_done_callback(self._ack_tasks.discard)

    async def collect_acks(self, version: int, published_at: float) -> None:
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
            self.last_sync |= sync_timings([a.timings for a in got.values()],
                                           time.monotonic() - published_at)

    def take_sync(self) -> dict[str, float]:
        """Sync timings that arrived since the last step's row, each reported once: repeating a
        stale one in later rows would skew the per-step means (the GPU benchmark averages them)."""
        out, self.last_sync = self.last_sync, {}
        return out


def sync_timings(timings: list[dict[str, float]], sync_s: float) -> dict[str, float]:
    """One version's sync figures from its producers' acks: the slowest producer's swap phases,
    the bytes streamed in all."""
    def slowest(key: str) -> float:
        return max(t.get(key, 0.0) for t in timings)

    return {
        "sync_s": sync_s,
        "swap_idle_s": slowest("idle_s"),
        "swap_drain_s": slowest("drain_s"),
        # What a long drain waited for: started prefills, and requests restarted.
        "swap_drain_waited": slowest("drain_waited"),
        "swap_drain_resubmitted": slowest("drain_resubmitted"),
        "swap_load_s": slowest("load_s"),
        "swap_stream_s": slowest("prepare_stream_s"),
        "stream_bytes": sum(t.get("prepare_stream_bytes", 0.0) for t in timings),
        "producers_acked": float(len(timings)),
    }
