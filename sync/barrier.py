"""The producer-side sync barrier: swap engine weights without losing or corrupting a request.

Protocol (mode ``drain_prefill``, the default), each step under its own timeout:
  1. gate: stop admitting new requests (callers block in ``tracker.admit()``);
  2. drain: requests without a first token are split by whether the scheduler has started them
     (``sync_scheduled_requests``, the worker extension's list of requests its model runner
     holds). A started one is mid-prefill: wait for its first token, so its whole prompt KV comes
     from the old weights (the ms-swift crash came from swapping while prefills were scheduled).
     A request not started has computed nothing: abort it, and its caller resubmits it, held
     at the gate, under the new version and its cache salt (``v<version>``), so it can neither
     start on the old weights nor reuse prompt KV the old weights computed for a sibling. The
     drain therefore lasts as long as the prefills under way, not the queue behind them;
  3. pause: ``pause_generation(mode="keep", clear_cache=False)`` freezes decoding requests;
  4. settle: wait until no output arrives any more, so tokens sampled by the old weights are
     tagged with the old version;
  5. load: the caller's load coroutine (snapshot via worker extension);
  6. version: tokens from now on are tagged v+1;
  7. resume + release admissions.
A failed or timed-out load keeps version v; ``finally`` always resumes the engine and reopens the
gate, so the engine is never left paused. Other modes, for comparison: ``keep`` (no drain),
``wait`` (pause mode "wait": drain everything), ``abort`` (abort in-flight requests; the
producer resubmits them under the new version).

Callers resubmit every request that ends with finish reason "abort" (same completion slot, a new
request id, its partial output discarded), which is all a drain-aborted request needs. Not
covered by the salt: a request vLLM preempts (KV cache full) and recomputes after a swap keeps
its old salt, so it may reuse prompt blocks the old weights computed.

The engine is reached only through ``pause_generation``/``resume_generation``, ``abort`` and
``collective_rpc`` (AsyncLLM has all four in vLLM 0.25 and 0.32), so this module is tested
against real engines and knows nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

BarrierMode = Literal["drain_prefill", "keep", "wait", "abort"]
# The vLLM worker extension the producer's engine loads (its drain and weight-load RPCs).
WORKER_EXTENSION = "sync.worker_ext.WeightSyncExtension"


class SwapError(RuntimeError):
    """A swap step failed or timed out; the engine was resumed on the previous version."""


class PausableEngine(Protocol):
    async def pause_generation(self, *, mode: str = ..., clear_cache: bool = ...) -> None: ...
    async def resume_generation(self) -> None: ...
    async def abort(self, request_id: str | Iterable[str]) -> None: ...
    async def collective_rpc(self, method: str) -> list[Any]: ...


# ------------------------------------------------------------------ drain decisions (pure)
def ours_from_engine_ids(engine_ids: Iterable[str], ours: Iterable[str]) -> set[str]:
    """Our request ids among the ids an engine's workers know.

    vLLM 0.25 and 0.32 give each request an internal id, ``<ours>-<8 random characters>``
    (``InputProcessor.assign_request_id``; the id unchanged when
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set), and with ``n > 1`` each sample is a child
    ``<index>_<internal id>``: a request counts once any of its children is known.
    """
    mine = set(ours)
    found: set[str] = set()
    for eid in engine_ids:
        for cand in _id_forms(eid):
            if cand in mine:
                found.add(cand)
                break
    return found


def _id_forms(eid: str) -> list[str]:
    """The ids ``eid`` may stand for, exact first (see ``ours_from_engine_ids``)."""
    forms = [eid]
    head, sep, tail = eid.partition("_")
    if sep and head.isdigit():  # a parallel-sampling child
        forms.append(tail)
    for f in list(forms):
        if len(f) > 9 and f[-9] == "-":
            forms.append(f[:-9])
    return forms


def split_pending(pending: Iterable[str], started: Iterable[str]) -> tuple[list[str], list[str]]:
    """(mid-prefill, not started) among requests without a first token, in ``pending``'s order.

    ``started`` is the engine's answer taken after the gate closed: a request it lacks either
    had no token computed then, or was admitted just before the gate and is not yet known to
    the engine; both are aborted and resubmitted (nothing of theirs was computed, or what was
    is dropped with them, its prefix-cache blocks keyed by the old salt).
    """
    begun = set(started)
    mid = [r for r in pending if r in begun]
    return mid, [r for r in pending if r not in begun]


def aborts_due(unstarted: Iterable[str], aborted_at: dict[str, float], now: float,
               retry_s: float) -> list[str]:
    """Unstarted requests to abort now (in the given order): new ones, and ones whose abort
    did not end them.

    An abort sent before AsyncLLM registered the request (it was admitted just before the gate
    closed) finds nothing to abort, and the request would then start on the old weights with
    the old salt; so a request still in flight ``retry_s`` after its abort is aborted again.
    The order is kept because it becomes the order of resubmission, hence of vLLM's
    first-come-first-served queue: aborting in admission order keeps each request's place.
    """
    return [r for r in unstarted if now - aborted_at.get(r, -math.inf) >= retry_s]


@dataclass
class RequestTracker:
    """In-flight requests of one engine, the admission gate and the current policy version.

    Shared by the producer's request coroutines and the barrier; single event loop, no locks.
    Progress (first token seen, tokens so far) comes from one of two places: output deltas
    (``on_output``, DELTA streaming) or, when ``probe`` is set, from the engine's own request
    state, so that FINAL_ONLY streaming (one output per completion, no per-token Python work)
    still drives the prefill drain and per-token version tags. ``probe`` returns
    {request id: (still prefilling, tokens generated so far)}.
    """

    version: int = 0
    in_flight: dict[str, bool] = field(default_factory=dict)  # request id -> first token seen
    last_output_at: float = 0.0
    swap_aborting: bool = False  # abort mode: aborted requests must be resubmitted
    probe: Callable[[], dict[str, tuple[bool, int]]] | None = None
    boundaries: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # probe mode
    _open: asyncio.Event | None = None
    _changed: asyncio.Event | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._open is None or self._changed is None:
            self._open, self._changed = asyncio.Event(), asyncio.Event()
            self._open.set()
        return self._open, self._changed

    @property
    def gate_open(self) -> bool:
        return self._events()[0].is_set()

    async def admit(self, request_id: str) -> int:
        """Wait for the gate, register the request; returns the version it starts under."""
        gate, _ = self._events()
        while not gate.is_set():
            await gate.wait()
        self.in_flight[request_id] = False
        return self.version

    def on_output(self, request_id: str, new_tokens: int) -> int:
        """Record an output delta; returns the version its tokens are tagged with."""
        self.last_output_at = time.monotonic()
        if new_tokens and not self.in_flight.get(request_id, True):
            self.in_flight[request_id] = True
            self._notify()
        return self.version

    def finish(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        self.boundaries.pop(request_id, None)
        self._notify()

    def _refresh(self) -> dict[str, tuple[bool, int]]:
        state = self.probe() if self.probe is not None else {}
        for rid, (prefilling, _n) in state.items():
            if not prefilling and rid in self.in_flight:
                self.in_flight[rid] = True
        return state

    def pending_prefills(self) -> int:
        return len(self.pending_ids())

    def pending_ids(self) -> list[str]:
        """Requests in flight that have no first token yet, in admission order."""
        self._refresh()
        return [rid for rid, seen in self.in_flight.items() if not seen]

    def activity(self) -> float:
        """Changes whenever the engine produces output (for the barrier's settle step)."""
        if self.probe is None:
            return self.last_output_at
        return float(sum(n for _p, n in self._refresh().values()))

    def set_version(self, version: int) -> None:
        """Tokens generated from now on belong to ``version`` (engine paused and settled)."""
        if self.probe is not None:
            state = self._refresh()
            for rid in self.in_flight:
                self.boundaries.setdefault(rid, []).append((state.get(rid, (True, 0))[1],
                                                            version))
        self.version = version

    def segments(self, request_id: str, start_version: int, num_tokens: int
                 ) -> list[tuple[int, int]]:
        """Probe mode: (first token index, version) runs of a finished request's tokens."""
        segs = [(0, start_version)]
        for n, v in self.boundaries.get(request_id, []):
            if n >= num_tokens:
                break
            if n == segs[-1][0]:
                segs[-1] = (n, v)  # no token generated under the previous version
            else:
                segs.append((n, v))
        return segs

    def _notify(self) -> None:
        _, changed = self._events()
        changed.set()

    async def wait_changed(self, timeout: float) -> None:
        """Return once a request has progressed or finished since the last call, or after
        ``timeout`` seconds (probe mode polls: FINAL_ONLY requests signal nothing until they
        finish). Clearing after the wait, not before, keeps a change that happened while the
        caller was busy from being missed."""
        _, changed = self._events()
        if self.probe is not None:
            timeout = min(timeout, 0.005)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)
        changed.clear()

    def close_gate(self) -> None:
        self._events()[0].clear()

    def open_gate(self) -> None:
        self._events()[0].set()


@dataclass
class SwapReport:
    """Timings of one swap (seconds) and its outcome; travels in the ack."""

    version: int
    ok: bool
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class SwapBarrier:
    engine: PausableEngine
    tracker: RequestTracker
    mode: BarrierMode = "drain_prefill"
    drain_timeout_s: float = 30.0
    pause_timeout_s: float = 60.0
    load_timeout_s: float = 120.0
    settle_s: float = 0.05
    abort_retry_s: float = 0.05
    swaps: int = 0
    failures: int = 0

    async def swap(self, new_version: int, load: Callable[[], Awaitable[Any]],
                   prepare: Callable[[], Awaitable[Any]] | None = None) -> SwapReport:
        """Run the barrier around ``load``; never raises for a failed load (see report.ok).

        ``prepare`` (optional) runs first, while the engine still serves and admits: work that
        needs no pause (reading and verifying the snapshot) stays out of the engine's idle time,
        and a snapshot it refuses never pauses the engine at all.
        """
        t: dict[str, float] = {}
        tk = self.tracker
        start = time.perf_counter()
        paused = False
        mark = start

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            t[name] = now - mark
            mark = now

        if prepare is not None:
            try:
                staged = await self._step("prepare", self.load_timeout_s, prepare())
            except Exception as e:
                self.failures += 1
                return SwapReport(version=tk.version, ok=False, error=f"swap to v{new_version} "
                                  f"refused before pausing: {e}",
                                  timings={"prepare_s": time.perf_counter() - start})
            lap("prepare_s")
            if isinstance(staged, dict):
                t.update({f"prepare_{k}": float(v) for k, v in staged.items()
                          if isinstance(v, (int, float))})
        tk.close_gate()
        try:
            lap("gate_s")
            if self.mode == "drain_prefill":
                t.update(await self._step("drain", self.drain_timeout_s, self._drain()))
            lap("drain_s")
            pause_started = time.perf_counter()
            if self.mode == "abort":
                tk.swap_aborting = True
            pause_mode = {"drain_prefill": "keep", "keep": "keep", "wait": "wait",
                          "abort": "abort"}[self.mode]
            # Set before awaiting: vLLM pauses its scheduler before pause_generation returns
            # (mode "wait" then waits for requests), so a timed-out pause must still resume.
            paused = True
            await self._step("pause", self.pause_timeout_s,
                             self.engine.pause_generation(mode=pause_mode, clear_cache=False))
            await self._step("settle", self.pause_timeout_s, self._settle())
            lap("pause_s")
            result = await self._step("load", self.load_timeout_s, load())
            lap("load_s")
            tk.set_version(new_version)
            await self._step("resume", self.pause_timeout_s, self.engine.resume_generation())
            paused = False
            lap("resume_s")
            t["idle_s"] = time.perf_counter() - pause_started
            if isinstance(result, dict):
                t.update({f"load_{k}": float(v) for k, v in result.items()
                          if isinstance(v, (int, float))})
            self.swaps += 1
            return SwapReport(version=new_version, ok=True, timings=t)
        except Exception as e:  # a failed swap is reported, never fatal for the producer
            self.failures += 1
            return SwapReport(version=tk.version, ok=False,
                              error=f"swap to v{new_version} failed: {e}", timings=t)
        finally:
            if paused:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.engine.resume_generation(),
                                           self.pause_timeout_s)
            tk.swap_aborting = False
            tk.open_gate()
            t["total_s"] = time.perf_counter() - start

    async def _drain(self) -> dict[str, float]:
        """Wait for the prefills under way; abort the requests not started, to be resubmitted.

        Runs with the gate closed, so no request joins. The engine's list of started requests
        is read once: a request it lacks is aborted (again every ``abort_retry_s`` while it is
        still in flight), so none can start on the old weights from then on, and the drain ends
        when every request left in flight has its first token.
        """
        tk = self.tracker
        if not tk.pending_ids():  # nothing to split: spare the engine a round trip
            return {"drain_waited": 0.0, "drain_resubmitted": 0.0}
        started = ours_from_engine_ids(await self._started_requests(), tk.in_flight)
        waited, _ = split_pending(tk.pending_ids(), started)
        aborted_at: dict[str, float] = {}
        while pending := tk.pending_ids():
            _, unstarted = split_pending(pending, started)
            now = time.monotonic()
            due = aborts_due(unstarted, aborted_at, now, self.abort_retry_s)
            if due:
                await self.engine.abort(due)
                aborted_at.update(dict.fromkeys(due, now))
            await tk.wait_changed(self.abort_retry_s)
        return {"drain_waited": float(len(waited)), "drain_resubmitted": float(len(aborted_at))}

    async def _started_requests(self) -> set[str]:
        """Ids (vLLM's internal form) of the requests any worker has begun computing."""
        try:
            per_worker = await self.engine.collective_rpc("sync_scheduled_requests")
        except Exception as e:
            raise SwapError(f"cannot list the engine's started requests (the engine needs the "
                            f"worker extension {WORKER_EXTENSION}): {e!r}") from None
        return {rid for ids in per_worker for rid in ids}

    async def _settle(self) -> None:
        """After a pause, wait until outputs stop arriving (they were sampled by old weights)."""
        tk = self.tracker
        if tk.probe is None:
            while time.monotonic() - tk.last_output_at < self.settle_s:
                await asyncio.sleep(self.settle_s / 2)
            return
        before = tk.activity()
        while True:
            await asyncio.sleep(self.settle_s / 2)
            now = tk.activity()
            if now == before:
                return
            before = now

    @staticmethod
    async def _step(name: str, timeout: float, aw: Awaitable[Any]) -> Any:
        try:
            return await asyncio.wait_for(aw, timeout)
        except TimeoutError:
            raise SwapError(f"step '{name}' timed out after {timeout:.1f}s") from None
