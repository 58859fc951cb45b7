"""Reward actors: the public API for user rewards, and the scorer that runs them for a group.

A user reward is any of:
- a function ``r(prompt: str, completion: str, **meta) -> float`` (sync or async);
- a class, instantiated once with ``RewardSpec.kwargs`` (setup state: a loaded verifier, an HTTP
  client); its ``__call__`` is the scorer, sync or async, with the signature above;
- a batched scorer (``batched=True``):
  ``(prompts: list[str], completions: list[str], metas: list[dict]) -> list[float]``, sync or async;
- a TRL GRPOTrainer reward as it is (``style="trl"``, or detected from its signature):
  ``f(completions, **kwargs) -> list[float | None]``, called once per group with the keywords
  ``prompts``, ``completions``, ``completion_ids`` and one list per dataset column (see
  ``trl_kwargs``); a ``None`` entry means "not scored by this reward" (see below).
``meta`` carries the dataset record's extra fields (e.g. ``answer``) plus ``prompt_id`` and
``completion_index``. A scorer whose signature has no ``**meta`` receives only the keywords it
names. ``@reward(name=..., batched=..., weight=...)`` attaches defaults that a spec may override.
A prompt is the dataset's value: a string, or a list of messages for conversational data.

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
- on timeout the waiting side gives up. A hung thread cannot be killed (Python has no way to), so
  thread rewards run on daemon threads that never block interpreter exit; a hung process call
  keeps its pool worker busy until ``close()`` terminates the pool;
- a call whose worker died under it (a process pool worker, a ``ray`` replica) is retried once
  and counted in ``reward/<name>/retries``; a second failure is a failure as above.
``executor="ray"`` (replicas on a Ray cluster, shared by the run's producers) is in
``pipeline.producer.ray_rewards``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import math
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.config import RewardSpec
from pipeline.producer.reward_calls import (
    CallMode,
    _defaults,
    _instantiate,
    _invoke,
    _meta_filter,
    _resolve_obj,
    _run_blocking,
    call_mode,
    load_callable,
    trl_kwargs,
)

log = logging.getLogger(__name__)

OnFailure = Literal["zero", "drop"]
STAT_KINDS = ("calls", "failures", "timeouts", "nan", "dropped_groups", "unscored", "retries")


# ------------------------------------------------------------------------------ user-facing API


def reward(
    fn: Any = None, *, name: str | None = None, batched: bool = False, weight: float = 1.0
) -> Any:
    """Attach defaults (name, batched, weight) to a reward function or class.

    Usable bare (``@reward``) or with arguments (``@reward(batched=True)``). A ``RewardSpec``
    field that is set explicitly wins over these defaults.
    """

    def attach(obj: Any) -> Any:
        obj.__reward_defaults__ = {"name": name, "batched": batched, "weight": weight}
        return obj

    return attach(fn) if fn is not None else attach


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


def validate_specs(specs: list[RewardSpec]) -> None:
    """Import every reward now and check names are unique, so bad config fails before any
    process starts. Classes are not instantiated here (that may be expensive)."""
    seen: set[str] = set()
    for spec in specs:
        obj = _resolve_obj(spec)
        name = _defaults(spec, obj)["name"]
        if name in seen:
            raise ValueError(
                f"duplicate reward name {name!r}; set RewardSpec.name to tell them apart"
            )
        seen.add(name)
        if spec.executor == "process" and not isinstance(spec.fn, str):
            qual = getattr(obj, "__qualname__", "")
            if "<locals>" in qual or "<lambda>" in qual:
                raise ValueError(
                    f"reward {name!r} runs in a process but {qual} cannot be "
                    "pickled; give its import path instead"
                )


# ------------------------------------------------------------------------------- spec plumbing


# Process-pool worker side. The registry lives only in spawned worker processes (filled by the
# pool initializer); the parent never reads or writes it.
_WORKER_SCORERS: dict[str, tuple[Callable[..., Any], frozenset[str] | None, CallMode]] = {}


def _worker_init(entries: list[tuple[str, Any, dict[str, Any], CallMode]]) -> None:
    for name, fn, kwargs, mode in entries:
        obj = load_callable(fn) if isinstance(fn, str) else fn
        scorer = _instantiate(obj, kwargs)
        _WORKER_SCORERS[name] = (scorer, _meta_filter(scorer), mode)


def _worker_call(name: str, args: tuple[Any, ...]) -> Any:
    scorer, accepts, mode = _WORKER_SCORERS[name]
    return _run_blocking(scorer, accepts, mode, args)


class _RewardTimeout(Exception):
    pass


class _NonFinite(Exception):
    pass


@dataclass
class _Actor:
    """One loaded reward with its limiters (parent side)."""

    spec: RewardSpec
    name: str
    weight: float
    mode: CallMode
    scorer: Callable[..., Any] | None  # None for process/ray rewards (lives in the workers)
    accepts: frozenset[str] | None
    throttler: Any = None
    remote: Any = None  # executor ray: the RayRewardClient of its replicas
    _sem: asyncio.Semaphore | None = None
    _sem_loop: asyncio.AbstractEventLoop | None = None

    def semaphore(self) -> asyncio.Semaphore | None:
        # asyncio primitives bind to the loop that first uses them; rebuild per loop so a
        # RewardSet survives being driven by successive asyncio.run() calls.
        if self.spec.max_concurrency is None:
            return None
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem = asyncio.Semaphore(self.spec.max_concurrency)
            self._sem_loop = loop
        return self._sem


def rate_limiter(rate_per_s: float) -> Any:
    """An asyncio-throttle Throttler allowing ``rate_per_s`` entries per second (async with)."""
    from asyncio_throttle import Throttler

    # Throttler counts whole calls per period: express a float rate as n calls per n/rate s.
    n = max(1, round(rate_per_s))
    return Throttler(rate_limit=n, period=n / rate_per_s)


# --------------------------------------------------------------------------------- the scorer


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
        self.pool_workers = pool_workers
        self.actors: list[_Actor] = []
        self.stats: dict[str, int] = {"reward/dropped_groups": 0, "reward/unscored_completions": 0}
        self.groups_scored = 0
        process_entries = []
        for spec in specs:
            obj = _resolve_obj(spec)
            d = _defaults(spec, obj)
            mode = call_mode(spec, obj, d["batched"])
            remote = None
            if spec.executor == "process":
                scorer, accepts = None, None
                process_entries.append((d["name"], spec.fn, dict(spec.kwargs), mode))
            elif spec.executor == "ray":
                from pipeline.producer.ray_rewards import RayRewardClient

                scorer, accepts = None, None
                remote = RayRewardClient.from_env(d["name"], self._retry_counter(d["name"]))
            else:
                scorer = _instantiate(obj, spec.kwargs)
                accepts = _meta_filter(scorer)
            throttler = rate_limiter(spec.rate_per_s) if spec.rate_per_s else None
            self.actors.append(
                _Actor(spec, d["name"], d["weight"], mode, scorer, accepts, throttler, remote)
            )
            for kind in STAT_KINDS:
                self.stats[f"reward/{d['name']}/{kind}"] = 0
        self._process_entries = process_entries
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        if process_entries:
            self._pool = self._new_pool()

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.actors]

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
        per_actor = await asyncio.gather(
            *(self._score_actor(a, prompt, completions, metas, completion_ids) for a in self.actors)
        )
        total = [0.0] * n
        breakdown: list[dict[str, float]] = [{} for _ in range(n)]
        scored_by_any = [False] * n
        failed_names = []
        for actor, (values, ok) in zip(self.actors, per_actor, strict=True):
            if not all(ok):
                failed_names.append(actor.name)
            for i in range(n):
                if ok[i] and values[i] is None:  # TRL's None: not scored by this reward
                    self.stats[f"reward/{actor.name}/unscored"] += 1
                    continue
                v = values[i] if ok[i] else 0.0
                breakdown[i][actor.name] = v
                total[i] += actor.weight * v
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
        self._closed = True
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _terminate_pool(pool)

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _retry_counter(self, name: str) -> Callable[[], None]:
        def count() -> None:
            self.stats[f"reward/{name}/retries"] += 1

        return count

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # spawn: forking a process that holds vLLM/torch threads is unsafe.
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=self.pool_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(self._process_entries,),
        )

    async def _score_actor(
        self,
        actor: _Actor,
        prompt: Any,
        completions: list[str],
        metas: list[dict[str, Any]],
        completion_ids: list[list[int]] | None,
    ) -> tuple[list[float | None], list[bool]]:
        """Values (None: not scored) and per-completion success flags of one reward."""
        n = len(completions)
        if actor.remote is not None and actor.mode == "single":
            return await self._score_remote_each(actor, prompt, completions, metas)
        if actor.mode != "single":
            args = (
                (trl_kwargs(prompt, completions, metas, completion_ids),)
                if actor.mode == "trl"
                else ([prompt] * n, list(completions), metas)
            )
            res = await self._guarded(actor, metas[0] if metas else {}, args, n)
            if res is None:
                return [0.0] * n, [False] * n
            return res, [v is None or math.isfinite(v) for v in res]
        outs = await asyncio.gather(
            *(
                self._guarded(actor, m, (prompt, c, m), None)
                for c, m in zip(completions, metas, strict=True)
            )
        )
        return ([o[0] if o else 0.0 for o in outs], [o is not None for o in outs])

    async def _guarded(
        self, actor: _Actor, meta: dict[str, Any], args: tuple[Any, ...], n: int | None
    ) -> list[float | None] | None:
        """One call with limits, timeout and validation; None on failure (already counted)."""
        key = f"reward/{actor.name}"
        self.stats[f"{key}/calls"] += 1
        try:
            raw = await self._limited_call(actor, args)
            values = _validate(raw, n, allow_none=actor.mode == "trl")
        except asyncio.CancelledError:
            raise
        except _RewardTimeout:
            self._fail(actor, meta, "timeout", f"timed out after {actor.spec.timeout_s} s")
            return None
        except _NonFinite as e:
            self._fail(actor, meta, "nan", str(e))
            # Keep the finite entries of a batched result; the caller zeroes the rest.
            return e.args[1] if n is not None else None
        except Exception as e:
            self._fail(actor, meta, None, f"raised {e!r}")
            return None
        return values

    async def _score_remote_each(
        self, actor: _Actor, prompt: Any, completions: list[str], metas: list[dict[str, Any]]
    ) -> tuple[list[float | None], list[bool]]:
        """A per-completion ray reward: the group's completions as one batch (one remote call
        under the reward's limits and timeout), failures counted per completion."""
        from pipeline.producer.ray_rewards import batch_items, split_results

        n = len(completions)
        self.stats[f"reward/{actor.name}/calls"] += n
        try:
            raw = await self._limited_call(
                actor, (batch_items(prompt, completions, metas),), "score_each"
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            kind = "timeout" if isinstance(e, _RewardTimeout) else None
            why = f"timed out after {actor.spec.timeout_s} s" if kind else f"raised {e!r}"
            for m in metas:
                self._fail(actor, m, kind, why)
            return [0.0] * n, [False] * n
        values: list[float | None] = []
        ok: list[bool] = []
        for (value, err), m in zip(split_results(raw, n), metas, strict=True):
            try:
                if err is not None:
                    raise RuntimeError(err)
                (v,) = _validate(value, None)
            except _NonFinite as e:
                self._fail(actor, m, "nan", str(e))
            except Exception as e:
                self._fail(actor, m, None, f"raised {e}")
            else:
                values.append(v)
                ok.append(True)
                continue
            values.append(0.0)
            ok.append(False)
        return values, ok

    async def _limited_call(
        self, actor: _Actor, args: tuple[Any, ...], method: str = "score"
    ) -> Any:
        sem = actor.semaphore()
        if sem is None:
            return await self._throttled_call(actor, args, method)
        async with sem:
            return await self._throttled_call(actor, args, method)

    async def _throttled_call(
        self, actor: _Actor, args: tuple[Any, ...], method: str = "score"
    ) -> Any:
        if actor.throttler is not None:
            async with actor.throttler:
                pass  # the throttler only spaces call starts; the call runs outside it
        # The timeout covers the call, not the queueing above.
        try:
            return await asyncio.wait_for(self._call(actor, args, method), actor.spec.timeout_s)
        except TimeoutError:
            raise _RewardTimeout() from None

    async def _call(self, actor: _Actor, args: tuple[Any, ...], method: str = "score") -> Any:
        if actor.remote is not None:
            # score: one call for the group (batched/trl); score_each: the group's completions.
            return await actor.remote.call(method, args if method == "score" else args[0])
        ex = actor.spec.executor
        if ex == "inline":
            out = _invoke(actor.scorer, actor.accepts, actor.mode, args)
            return await out if inspect.isawaitable(out) else out
        if ex == "thread":
            return await _in_daemon_thread(
                _run_blocking, actor.scorer, actor.accepts, actor.mode, args
            )
        return await self._in_process(actor.name, args)

    async def _in_process(self, name: str, args: tuple[Any, ...]) -> Any:
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            with self._pool_lock:
                if self._closed or self._pool is None:
                    raise RuntimeError("RewardSet is closed")
                pool = self._pool
            try:
                return await asyncio.wrap_future(pool.submit(_worker_call, name, args), loop=loop)
            except concurrent.futures.process.BrokenProcessPool:
                # A worker died (segfault, OOM kill): replace the pool once and retry.
                if attempt:
                    raise
                self.stats[f"reward/{name}/retries"] += 1
                log.warning("reward process pool broke; restarting it")
                with self._pool_lock:
                    if self._pool is pool and not self._closed:
                        self._pool = self._new_pool()
                _terminate_pool(pool)
        raise AssertionError("unreachable")

    def _fail(self, actor: _Actor, meta: dict[str, Any], kind: str | None, why: str) -> None:
        self.stats[f"reward/{actor.name}/failures"] += 1
        if kind == "timeout":
            self.stats[f"reward/{actor.name}/timeouts"] += 1
        elif kind == "nan":
            self.stats[f"reward/{actor.name}/nan"] += 1
        log.warning(
            "prompt %s: reward %s %s (on_failure=%s)",
            meta.get("prompt_id"),
            actor.name,
            why,
            self.on_failure,
        )


def _validate(raw: Any, n: int | None, allow_none: bool = False) -> list[float | None]:
    """Coerce a scorer's output to floats (None kept where ``allow_none``: not scored); raise
    _NonFinite for NaN/inf, TypeError for junk."""
    if n is None:
        items = [raw]
    else:
        if isinstance(raw, str | bytes) or not hasattr(raw, "__len__"):
            raise TypeError(f"batched reward returned {type(raw).__name__}, expected a list")
        items = list(raw)
        if len(items) != n:
            raise TypeError(f"batched reward returned {len(items)} values for {n} completions")
    values: list[float | None] = []
    for v in items:
        if v is None and allow_none:
            values.append(None)
            continue
        if isinstance(v, str | bytes) or v is None:
            raise TypeError(f"reward returned {v!r}, expected a number")
        values.append(float(v))
    bad = [v for v in values if v is not None and not math.isfinite(v)]
    if bad:
        raise _NonFinite(f"returned non-finite value(s) {bad[:3]}", values)
    return values


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on a fresh daemon thread; the awaiting side may give up (wait_for) at any time.

    Not the loop's default executor: a hung call there would hold a pool slot forever and
    block interpreter exit, whereas a daemon thread is simply abandoned.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            res = fn(*args)
        except BaseException as e:  # delivered to the awaiting side
            ok, res = False, e
        else:
            ok = True
        # RuntimeError: the loop closed while we ran (an abandoned call); nobody is waiting.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, ok, res)

    threading.Thread(target=target, name="reward-thread", daemon=True).start()
    return await fut


def _terminate_pool(pool: concurrent.futures.ProcessPoolExecutor, grace_s: float = 2.0) -> None:
    """Stop a pool without waiting for hung calls, and return only once its workers are gone:
    cancel queued work, SIGTERM the workers this RewardSet started (by their process objects),
    SIGKILL those still running after ``grace_s``, then wait for every one of them to exit."""
    procs = list(getattr(pool, "_processes", {}).values())  # no public API before 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    running = _wait_exited(procs, grace_s)
    for p in running:
        p.kill()
    _wait_exited(running, None)  # SIGKILL cannot be caught: this wait ends
    for p in procs:
        # The pool's manager thread joins the same workers; whichever thread reaps one sets its
        # exit code, so wait for that here rather than return with a worker not yet reaped.
        deadline = time.monotonic() + 10.0
        while p.exitcode is None and time.monotonic() < deadline:
            p.join(0.05)


def _wait_exited(procs: list[Any], timeout: float | None) -> list[Any]:
    """Wait up to ``timeout`` (None: forever) for ``procs`` to exit; returns those still running.
    A process's sentinel becomes ready when it exits, whichever thread reaps it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    running = [p for p in procs if not _exited(p)]
    while running:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        multiprocessing.connection.wait([p.sentinel for p in running], left)
        running = [p for p in running if not _exited(p)]
    return running


def _exited(p: Any) -> bool:
    return p.exitcode is not None or bool(multiprocessing.connection.wait([p.sentinel], 0))
