"""The reward set: every configured reward, loaded once per producer, scoring one group at a
time, and the counters of what happened (``reward/<name>/<kind>``).

Each reward runs on its executor: ``inline`` (the event loop), ``thread``, ``process``
(``pipeline.producer.rewards.executors``) or ``ray`` (``pipeline.producer.rewards.ray_replicas``),
and every call goes through ``call_reward`` (``pipeline.producer.rewards.call``) under the
reward's limits.

The weighted sum of a completion covers the rewards that scored it: a TRL reward's ``None``
adds nothing (as TRL's nansum does) and leaves that reward out of the completion's breakdown,
so per-reward means are taken over the completions each reward scored. A completion no reward
scored gets total 0.0 and is counted in ``reward/unscored_completions``. ``None`` from a native
reward is a bug in the reward (counted as a failure).

Invariants of ``RewardSet.score_group``:
- it never raises (except on cancellation) and never waits longer than the slowest reward's
  ``timeout_s`` per call (plus queueing for ``max_concurrency``/``rate_per_s``), provided
  ``inline`` rewards are fast: an ``inline`` *sync* reward runs on the event loop and cannot be
  timed out, so anything that may block belongs on ``executor="thread"`` or ``"process"``;
- every exception, timeout and non-finite value is logged with the prompt id, counted in
  ``stats`` and handled by ``on_failure``: ``"zero"`` scores that reward 0 for the affected
  completions, ``"drop"`` marks the result ``dropped`` so the caller discards the group;
- a call whose worker died under it (a process pool worker, a ``ray`` replica) is retried once
  and counted in ``reward/<name>/retries``; a second failure is a failure as above.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from pipeline.config import RewardSpec
from pipeline.producer.rewards.call import (
    CallLimits,
    NonFinite,
    RewardTimeout,
    call_blocking,
    call_inline,
    call_reward,
    coerce,
    trl_kwargs,
)
from pipeline.producer.rewards.executors import PoolEntry, ProcessPool
from pipeline.producer.rewards.loading import (
    CallMode,
    RewardInfo,
    Scorer,
    build_scorer,
    describe,
    validate_specs,
)
from pipeline.producer.rewards.ray_replicas import RayRewardClient, batch_items, split_results
from sync.threads import in_daemon_thread

log = logging.getLogger(__name__)

OnFailure = Literal["zero", "drop"]
STAT_KINDS = ("calls", "failures", "timeouts", "nan", "dropped_groups", "unscored", "retries")

Run = Callable[[tuple[Any, ...]], Awaitable[Any]]


@dataclass
class RewardResult:
    """Scores of one group."""

    total: list[float]
    """Weighted sum per completion over the rewards that scored it (a failed reward
    contributes 0)."""
    breakdown: list[dict[str, float]]
    """Per completion: reward name -> value used (raw, unweighted; 0.0 where it failed; absent
    where the reward returned None: not scored)."""
    failed: bool
    """Some reward failed (exception, timeout or non-finite value) for some completion."""
    dropped: bool
    """on_failure == "drop" and a failure happened: the caller must discard the group."""


@dataclass
class _Loaded:
    """One reward of the set: how to run one call of it, and its limits."""

    name: str
    weight: float
    mode: CallMode
    limits: CallLimits
    run: Run
    """One call on its executor; for a per-completion ray reward the group's batch."""
    scorer: Scorer | None
    """The built reward (``inline`` and ``thread``; the others build it in their workers)."""
    remote: RayRewardClient | None
    """The link to its replicas (``executor: ray``)."""


async def _each_of_batch(remote: RayRewardClient, args: tuple[Any, ...]) -> Any:
    """A per-completion ray reward's call: ``args`` is ``(the group's batch,)``."""
    return await remote.call("score_each", args[0])


class RewardSet:
    """All configured rewards; scores one group at a time (``score_group`` is safe to run
    concurrently for many groups)."""

    def __init__(
        self, specs: list[RewardSpec], on_failure: OnFailure = "zero", pool_workers: int = 2
    ) -> None:
        if on_failure not in ("zero", "drop"):
            raise ValueError(f"on_failure must be 'zero' or 'drop', got {on_failure!r}")
        if pool_workers < 1:
            raise ValueError(f"pool_workers must be >= 1, got {pool_workers}")
        validate_specs(specs)
        self.on_failure = on_failure
        self.stats: dict[str, int] = {"reward/dropped_groups": 0, "reward/unscored_completions": 0}
        self.groups_scored = 0
        self.pool: ProcessPool | None = None
        pool_entries: list[PoolEntry] = []
        self.rewards: list[_Loaded] = []
        for spec in specs:
            info = describe(spec)
            for kind in STAT_KINDS:
                self.stats[f"reward/{info.name}/{kind}"] = 0
            if spec.executor == "process":
                pool_entries.append((info.name, spec.fn, dict(spec.kwargs), info.mode))
            self.rewards.append(self._load(spec, info))
        if pool_entries:
            self.pool = ProcessPool(pool_entries, pool_workers, self._count_retry)

    def _load(self, spec: RewardSpec, info: RewardInfo) -> _Loaded:
        """The reward built (``inline``, ``thread``) or linked to its replicas (``ray``), and
        how one call of it runs on its executor."""
        scorer: Scorer | None = None
        remote: RayRewardClient | None = None
        run: Run
        if spec.executor == "ray":
            remote = RayRewardClient.from_env(info.name, lambda: self._count_retry(info.name))
            run = partial(remote.call, "score")
            if info.mode == "single":
                run = partial(_each_of_batch, remote)
        elif spec.executor == "process":
            run = partial(self._in_pool, info.name)
        else:
            scorer = build_scorer(info.obj, spec.kwargs, info.mode)
            if spec.executor == "thread":
                run = partial(in_daemon_thread, call_blocking, scorer, name="reward-thread")
            else:
                run = partial(call_inline, scorer)
        limits = CallLimits(spec.timeout_s, spec.max_concurrency, spec.rate_per_s)
        return _Loaded(info.name, info.weight, info.mode, limits, run, scorer, remote)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    # -- public -------------------------------------------------------------------------------

    async def score_group(
        self,
        prompt: Any,
        completions: list[str],
        meta: dict[str, Any],
        completion_ids: list[list[int]] | None = None,
    ) -> RewardResult:
        """Score the G completions of one prompt with every reward, concurrently.

        ``prompt`` is the dataset's prompt (a string, or a list of messages); ``completion_ids``
        the completions' token ids, passed to TRL-style rewards as ``completion_ids``.
        """
        n = len(completions)
        self.groups_scored += 1
        metas = [{**meta, "completion_index": i} for i in range(n)]
        per_reward = await asyncio.gather(
            *(self._score_one(r, prompt, completions, metas, completion_ids) for r in self.rewards)
        )
        total = [0.0] * n
        breakdown: list[dict[str, float]] = [{} for _ in range(n)]
        scored_by_any = [False] * n
        failed_names = []
        for r, (values, ok) in zip(self.rewards, per_reward, strict=True):
            if not all(ok):
                failed_names.append(r.name)
            for i in range(n):
                if ok[i] and values[i] is None:  # TRL's None: not scored by this reward
                    self.stats[f"reward/{r.name}/unscored"] += 1
                    continue
                v = values[i] if ok[i] else 0.0
                breakdown[i][r.name] = v
                total[i] += r.weight * v
                scored_by_any[i] = True
        self.stats["reward/unscored_completions"] += scored_by_any.count(False)
        failed = bool(failed_names)
        dropped = failed and self.on_failure == "drop"
        if dropped:
            self.stats["reward/dropped_groups"] += 1
            for name in failed_names:
                self.stats[f"reward/{name}/dropped_groups"] += 1
            log.warning(
                "prompt %s: group dropped, rewards failed: %s",
                meta.get("prompt_id"),
                ", ".join(failed_names),
            )
        return RewardResult(total=total, breakdown=breakdown, failed=failed, dropped=dropped)

    def reported_stats(self) -> dict[str, int]:
        """The counters to log: every one once this set has scored a group, none before. An
        episode run whose episodes return their own rewards never calls the reward functions,
        and their counters, all 0, would read as rewards that ran and never failed."""
        return dict(self.stats) if self.groups_scored else {}

    def close(self) -> None:
        """Shut down the process pool, terminating workers stuck in hung calls."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _count_retry(self, name: str) -> None:
        self.stats[f"reward/{name}/retries"] += 1

    async def _in_pool(self, name: str, args: tuple[Any, ...]) -> Any:
        if self.pool is None:
            raise RuntimeError("RewardSet has no process pool")
        return await self.pool.call(name, args)

    async def _score_one(
        self,
        r: _Loaded,
        prompt: Any,
        completions: list[str],
        metas: list[dict[str, Any]],
        completion_ids: list[list[int]] | None,
    ) -> tuple[list[float | None], list[bool]]:
        """Values (None: not scored) and per-completion success flags of one reward."""
        n = len(completions)
        if r.remote is not None and r.mode == "single":
            return await self._score_remote_each(r, prompt, completions, metas)
        if r.mode != "single":
            args = (
                (trl_kwargs(prompt, completions, metas, completion_ids),)
                if r.mode == "trl"
                else ([prompt] * n, list(completions), metas)
            )
            res = await self._guarded(r, metas[0] if metas else {}, args, n)
            if res is None:
                return [0.0] * n, [False] * n
            return res, [v is None or math.isfinite(v) for v in res]
        outs = await asyncio.gather(
            *(
                self._guarded(r, m, (prompt, c, m), None)
                for c, m in zip(completions, metas, strict=True)
            )
        )
        return ([o[0] if o else 0.0 for o in outs], [o is not None for o in outs])

    async def _guarded(
        self, r: _Loaded, meta: dict[str, Any], args: tuple[Any, ...], n: int | None
    ) -> list[float | None] | None:
        """One call, its result coerced; None on failure (already counted)."""
        self.stats[f"reward/{r.name}/calls"] += 1
        try:
            return coerce(await call_reward(r.run, args, r.limits), n, allow_none=r.mode == "trl")
        except asyncio.CancelledError:
            raise
        except RewardTimeout:
            self._fail(r, meta, "timeout", f"timed out after {r.limits.timeout_s} s")
            return None
        except NonFinite as e:
            self._fail(r, meta, "nan", str(e))
            # Keep the finite entries of a batched result; the caller zeroes the rest.
            return e.values if n is not None else None
        except Exception as e:
            self._fail(r, meta, None, f"raised {e!r}")
            return None

    async def _score_remote_each(
        self, r: _Loaded, prompt: Any, completions: list[str], metas: list[dict[str, Any]]
    ) -> tuple[list[float | None], list[bool]]:
        """A per-completion ray reward: the group's completions as one batch (one remote call
        under the reward's limits and timeout), failures counted per completion."""
        n = len(completions)
        self.stats[f"reward/{r.name}/calls"] += n
        try:
            raw = await call_reward(r.run, (batch_items(prompt, completions, metas),), r.limits)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            kind = "timeout" if isinstance(e, RewardTimeout) else None
            why = f"timed out after {r.limits.timeout_s} s" if kind else f"raised {e!r}"
            for m in metas:
                self._fail(r, m, kind, why)
            return [0.0] * n, [False] * n
        values: list[float | None] = []
        ok: list[bool] = []
        for (value, err), m in zip(split_results(raw, n), metas, strict=True):
            try:
                if err is not None:
                    raise RuntimeError(err)
                (v,) = coerce(value, None)
            except NonFinite as e:
                self._fail(r, m, "nan", str(e))
            except Exception as e:
                self._fail(r, m, None, f"raised {e}")
            else:
                values.append(v)
                ok.append(True)
                continue
            values.append(0.0)
            ok.append(False)
        return values, ok

    def _fail(self, r: _Loaded, meta: dict[str, Any], kind: str | None, why: str) -> None:
        self.stats[f"reward/{r.name}/failures"] += 1
        if kind == "timeout":
            self.stats[f"reward/{r.name}/timeouts"] += 1
        elif kind == "nan":
            self.stats[f"reward/{r.name}/nan"] += 1
        log.warning(
            "prompt %s: reward %s %s (on_failure=%s)",
            meta.get("prompt_id"),
            r.name,
            why,
            self.on_failure,
        )
