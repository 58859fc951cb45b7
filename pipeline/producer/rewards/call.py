"""Calling one reward: the arguments of its convention, the call itself, the limits around it
and the coercion of what it returns.

Invariants:
- ``invoke`` is the only place a user's reward is called. Every executor goes through it: the
  event loop (``call_inline``), a thread, a process pool worker or a Ray replica
  (``call_blocking``, which drives an async reward to completion on a private loop);
- ``call_reward`` is the one way the reward set calls a reward on its executor: it waits for a
  ``max_concurrency`` slot, then a ``rate_per_s`` start, then runs the call within ``timeout_s``
  (the timeout covers the call, not the queueing) and raises ``RewardTimeout`` when it runs out;
- ``coerce`` turns a result into floats or raises: a non-number, a list of the wrong length or
  (outside TRL's convention) ``None`` is a TypeError, NaN/inf a ``NonFinite``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.producer.rewards.loading import Scorer


def trl_kwargs(
    prompt: Any,
    completions: list[str],
    metas: list[dict[str, Any]],
    completion_ids: list[list[int]] | None,
) -> dict[str, Any]:
    """The keywords TRL's GRPOTrainer passes a reward function, for one group of n completions.

    ``prompts`` and ``completions`` are lists of strings, or for a conversational prompt (a list
    of messages) the prompt's messages and ``[{"role": "assistant", "content": text}]`` per
    completion; ``completion_ids`` the sampled token ids; every other key of the metas (the
    dataset's columns, ``prompt_id``, ``completion_index``) a list with one entry per completion.
    """
    n = len(completions)
    conversational = isinstance(prompt, list)
    kw: dict[str, Any] = {
        "prompts": [prompt] * n,
        "completions": [[{"role": "assistant", "content": c}] for c in completions]
        if conversational
        else list(completions),
    }
    if completion_ids is not None:
        kw["completion_ids"] = [[int(t) for t in ids] for ids in completion_ids]
    for key in metas[0] if metas else ():
        if key not in kw:
            kw[key] = [m.get(key) for m in metas]
    return kw


def invoke(scorer: Scorer, args: tuple[Any, ...]) -> Any:
    """Call the reward in its convention; the result may be a value or an awaitable.

    ``args`` is ``(prompt, completion, meta)`` for a per-completion reward, ``(prompts,
    completions, metas)`` for a batched one and ``(trl_kwargs,)`` for a TRL-style one; keywords
    the reward does not accept are left out.
    """
    if scorer.mode == "batched":
        return scorer.fn(*args)
    if scorer.mode == "trl":
        (kw,) = args
        if scorer.accepts is not None:
            kw = {k: v for k, v in kw.items() if k in scorer.accepts}
        return scorer.fn(**kw)
    prompt, completion, meta = args
    if scorer.accepts is not None:
        meta = {k: v for k, v in meta.items() if k in scorer.accepts}
    return scorer.fn(prompt, completion, **meta)


async def call_inline(scorer: Scorer, args: tuple[Any, ...]) -> Any:
    """Call the reward on the running event loop, awaiting it if it is async. A sync reward
    blocks the loop for as long as it runs (which is why ``inline`` is for fast rewards)."""
    out = invoke(scorer, args)
    return await out if inspect.isawaitable(out) else out


def call_blocking(scorer: Scorer, args: tuple[Any, ...]) -> Any:
    """Call the reward off the event loop (a thread, a process worker, a Ray replica), driving
    an async reward to completion on a private loop."""
    out = invoke(scorer, args)
    if inspect.isawaitable(out):

        async def await_it() -> Any:
            return await out

        out = asyncio.run(await_it())
    return out


class RewardTimeout(Exception):
    """A reward call ran past its ``timeout_s`` (the waiting side gave up)."""


class NonFinite(Exception):
    """A reward returned NaN or inf; ``values`` holds the coerced result, so the finite entries
    of a batched result can still be used."""

    def __init__(self, message: str, values: list[float | None]) -> None:
        super().__init__(message)
        self.values = values


def coerce(raw: Any, n: int | None, allow_none: bool = False) -> list[float | None]:
    """A reward's result as floats: one value (``n`` None) or a list of ``n`` (batched, TRL).
    ``None`` is kept where ``allow_none`` (TRL's "not scored by this reward")."""
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
        raise NonFinite(f"returned non-finite value(s) {bad[:3]}", values)
    return values


def rate_limiter(rate_per_s: float) -> Any:
    """An asyncio-throttle Throttler allowing ``rate_per_s`` entries per second (async with)."""
    from asyncio_throttle import Throttler

    # Throttler counts whole calls per period: express a float rate as n calls per n/rate s.
    n = max(1, round(rate_per_s))
    return Throttler(rate_limit=n, period=n / rate_per_s)


class CallLimits:
    """One reward's limits, shared by all its calls in this process: ``max_concurrency`` calls
    at a time, ``rate_per_s`` starts per second, ``timeout_s`` per call."""

    def __init__(
        self, timeout_s: float, max_concurrency: int | None, rate_per_s: float | None
    ) -> None:
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.throttler = rate_limiter(rate_per_s) if rate_per_s else None
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None

    def semaphore(self) -> asyncio.Semaphore | None:
        """The ``max_concurrency`` slots of the running loop (None: unlimited). asyncio
        primitives bind to the loop that first uses them; rebuilt per loop so a reward set
        survives being driven by successive ``asyncio.run()`` calls."""
        if self.max_concurrency is None:
            return None
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._sem_loop = loop
        return self._sem


async def call_reward(
    run: Callable[[tuple[Any, ...]], Awaitable[Any]], args: tuple[Any, ...], limits: CallLimits
) -> Any:
    """One call of a reward: ``run(args)`` (its executor) under ``limits``; the raw result.

    Raises ``RewardTimeout`` when the call runs past ``limits.timeout_s``, and whatever the
    reward raised."""
    sem = limits.semaphore()
    if sem is None:
        return await _started(run, args, limits)
    async with sem:
        return await _started(run, args, limits)


async def _started(
    run: Callable[[tuple[Any, ...]], Awaitable[Any]], args: tuple[Any, ...], limits: CallLimits
) -> Any:
    if limits.throttler is not None:
        async with limits.throttler:
            pass  # the throttler only spaces call starts; the call runs outside it
    try:
        return await asyncio.wait_for(run(args), limits.timeout_s)
    except TimeoutError:
        raise RewardTimeout() from None
