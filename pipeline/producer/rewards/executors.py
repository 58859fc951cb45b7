"""Where a reward call runs off the event loop in this machine: a fresh daemon thread per call
(``executor: thread``) or a spawn process pool (``executor: process``).

Invariants:
- the waiting side may give up (a timeout) at any time. A hung thread cannot be killed (Python
  has no way to), so threads are daemons that never block interpreter exit; a hung process call
  keeps its worker busy until ``ProcessPool.close`` terminates the pool;
- a pool whose worker died (segfault, OOM kill) is replaced once and the call retried (the
  caller counts it); a second death is the call's failure;
- ``ProcessPool.close`` returns only once every worker has exited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.producer.rewards.call import call_blocking
from pipeline.producer.rewards.loading import CallMode, Scorer, build_scorer

log = logging.getLogger(__name__)

PoolEntry = tuple[str, Any, dict[str, Any], CallMode]
"""A reward the pool's workers build: (name, function or class or its import path, kwargs,
calling convention)."""


# Worker side. The registry lives only in spawned worker processes (filled by the pool
# initializer); the parent never reads or writes it.
_WORKER_SCORERS: dict[str, Scorer] = {}


def _worker_init(entries: list[PoolEntry]) -> None:
    for name, fn, kwargs, mode in entries:
        _WORKER_SCORERS[name] = build_scorer(fn, kwargs, mode)


def _worker_call(name: str, args: tuple[Any, ...]) -> Any:
    return call_blocking(_WORKER_SCORERS[name], args)


class ProcessPool:
    """The ``executor: process`` rewards of one reward set, built once in each of ``workers``
    spawned processes (forking a process that holds vLLM/torch threads is unsafe)."""

    def __init__(
        self, entries: list[PoolEntry], workers: int, on_retry: Callable[[str], None]
    ) -> None:
        self.entries = entries
        self.workers = workers
        self.on_retry = on_retry
        self._lock = threading.Lock()
        self._closed = False
        self._pool: concurrent.futures.ProcessPoolExecutor | None = self._new_pool()

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(self.entries,),
        )

    def processes(self) -> list[Any]:
        """The current pool's worker processes (none once closed)."""
        with self._lock:
            pool = self._pool
        return list(getattr(pool, "_processes", {}).values())  # no public API before 3.14

    async def call(self, name: str, args: tuple[Any, ...]) -> Any:
        """Reward ``name`` called with ``args`` in a worker; retried once (``on_retry(name)``)
        in a fresh pool if a worker died under it."""
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            with self._lock:
                if self._closed or self._pool is None:
                    raise RuntimeError("the reward process pool is closed")
                pool = self._pool
            try:
                return await asyncio.wrap_future(pool.submit(_worker_call, name, args), loop=loop)
            except concurrent.futures.process.BrokenProcessPool:
                if attempt:
                    raise
                self.on_retry(name)
                log.warning("reward process pool broke; restarting it")
                with self._lock:
                    if self._pool is pool and not self._closed:
                        self._pool = self._new_pool()
                terminate_pool(pool)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Shut the pool down, terminating workers stuck in hung calls."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            terminate_pool(pool)


def terminate_pool(pool: concurrent.futures.ProcessPoolExecutor, grace_s: float = 2.0) -> None:
    """Stop a pool without waiting for hung calls, and return only once its workers are gone:
    cancel queued work, SIGTERM the pool's workers (by their process objects), SIGKILL those
    still running after ``grace_s``, then wait for every one of them to exit."""
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
