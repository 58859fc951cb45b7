"""The learner's side of evaluation: the figures each evaluated version gets (one metrics row
tagged ``eval/version``, one console line), the wait for the last version's at the end, and
what the learner knows of a dedicated evaluator (``eval.producer: dedicated``).

Invariants: a dedicated evaluator is never one of the learner's producers. It is not in their
table, so no version waits for its ack, no route or GPU copy is planned for it (it loads each
version's file), it has no admission share, data shard or cursor, and the groups it could send
are refused (``buffer.identity``). Its heartbeats only feed ``evaluator_alive`` and the
``evaluator/<counter>`` keys of each step's row; a run without one logs neither.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from buffer.protocol import EvalResult, Heartbeat, Hello
from pipeline.config import RunConfig
from pipeline.learner.producers import ProducerInfo
from pipeline.procs import ConsoleStream
from pipeline.schedule import EVALUATOR_ID, evaluator_index, is_due, last_version

log = logging.getLogger(__name__)
EVALUATOR_RESTART_S = 180.0  # silent this long, a dedicated evaluator is not coming back


class Evaluations:
    def __init__(self, cfg: RunConfig, metrics: Any):
        """``metrics``: the learner's ``MetricsLogger``."""
        self.cfg, self.metrics = cfg, metrics
        self.evaluated: dict[int, dict[str, float]] = {}  # version -> its eval/* figures
        ev = cfg.eval
        self.dedicated = evaluator_index(cfg.producer_slots, ev.every, ev.producer) is not None
        self.ids = frozenset({EVALUATOR_ID}) if self.dedicated else frozenset()
        self.evaluators: dict[str, ProducerInfo] = {}

    def hello(self, msg: Hello, new: bool) -> None:
        """A dedicated evaluator introduced itself (``new``: a new process)."""
        info = self.evaluators.setdefault(msg.producer_id, ProducerInfo())
        info.pid, info.version = msg.pid, msg.policy_version
        # Heard from now: a Hello just before the final wait is not a silent evaluator.
        info.last_seen = time.monotonic()
        if new:
            info.stats = {}
            log.info("evaluator %s (pid %d) connected (incarnation %s)", msg.producer_id,
                     msg.pid, msg.incarnation)

    def heard(self, producer_id: str, msg: Any, step: int) -> None:
        """A checked control message from the evaluator ``producer_id``."""
        info = self.evaluators[producer_id]
        info.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            info.version, info.stats = msg.policy_version, dict(msg.stats)
        elif isinstance(msg, EvalResult):
            self.result(msg, step)

    def result(self, msg: EvalResult, step: int) -> None:
        """An evaluation's figures: one metrics row (at the current ``step``) tagged with the
        version they measure, and one console line. A second one of a version (the shared role
        moved to another producer while the first was evaluating it) is not logged again."""
        if msg.version in self.evaluated:
            log.info("eval v%d from %s: already evaluated; not logged again", msg.version,
                     msg.producer_id)
            return
        self.evaluated[msg.version] = dict(msg.stats)
        self.metrics.log(step, {"eval/version": float(msg.version), **msg.stats},
                         progress=False)
        k = self.cfg.eval.samples_per_prompt
        print(f"eval v{msg.version}: reward {msg.stats.get('eval/reward_mean', 0.0):.3f}, "
              f"pass@{k} {msg.stats.get(f'eval/pass@{k}', 0.0):.3f} "
              f"({int(msg.stats.get('eval/prompts', 0))} prompts, "
              f"{msg.stats.get('eval/seconds', 0.0):.1f} s)", file=ConsoleStream(), flush=True)

    def step_metrics(self) -> dict[str, float]:
        """For each step's row, with a dedicated evaluator only: whether it is alive and its
        counters (``evaluator/evaluations``, ``evaluator/versions_skipped``, ...)."""
        if not self.dedicated:
            return {}
        now = time.monotonic()
        out = {"evaluator_alive": float(sum(i.alive(now) for i in self.evaluators.values()))}
        for info in self.evaluators.values():
            out.update({f"evaluator/{k}": float(v) for k, v in info.stats.items()})
        return out

    def evaluator_gone(self) -> bool:
        """Whether the dedicated evaluator said Hello but has been silent for
        ``EVALUATOR_RESTART_S``: then no evaluation will come. Not alive is not enough: the
        launcher restarts a dead evaluator, whose engine takes a while to start."""
        now = time.monotonic()
        return bool(self.evaluators) and \
            all(now - i.last_seen >= EVALUATOR_RESTART_S for i in self.evaluators.values())

    async def await_last(self, version: int) -> None:
        """Training is over at ``version``: wait (``eval.timeout_s``) for its evaluation, which
        the first producer or the evaluator may still be running; not for an evaluator silent
        for good (``evaluator_gone``)."""
        ev, v = self.cfg.eval, version
        if not ev.every or v in self.evaluated:
            return
        if not is_due(v, ev.every, last_version(self.cfg.train.steps, self.cfg.sync.sync_every)):
            # A skipped (non-finite) update published fewer versions than the producers expect.
            log.warning("the last version, %d, is not one the producers evaluate; no final "
                        "evaluation", v)
            return
        deadline = time.monotonic() + ev.timeout_s
        while v not in self.evaluated and time.monotonic() < deadline:
            if self.evaluator_gone():
                log.warning("no evaluation of the last version %d: the evaluator is silent "
                            "(dead?)", v)
                return
            await asyncio.sleep(0.1)
        if v not in self.evaluated:
            log.warning("no evaluation of the last version %d within eval.timeout_s (%.0f s)",
                        v, ev.timeout_s)
