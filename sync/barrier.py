"""The producer-side sync barrier: swap engine weights without losing or corrupting a request.

Protocol (mode ``drain_prefill``, the default), each step under its own timeout:
  1. gate: stop admitting new requests (callers block in ``tracker.admit()``);
  2. drain: wait until every in-flight request has produced its first token, i.e. its prompt is
     fully prefilled (the ms-swift crash came from swapping while prefills were scheduled);
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

The engine is reached only through ``pause_generation``/``resume_generation`` (AsyncLLM has both
in vLLM 0.25 and 0.32), so this module is tested against real engines and knows nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

BarrierMode = Literal["drain_prefill", "keep", "wait", "abort"]


class SwapError(RuntimeError):
    """A swap step failed or timed out; the engine was resumed on the previous version."""


class PausableEngine(Protocol):
    async def pause_generation(self, *, mode: str = ..., clear_cache: bool = ...) -> None: ...
    async def resume_generation(self) -> None: ...


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
        self._refresh()
        return sum(1 for seen in self.in_flight.values() if not seen)

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

    async def wait_until(self, pred: Callable[[], bool]) -> None:
        _, changed = self._events()
        while not pred():
            changed.clear()
            if self.probe is not None:  # engine progress is polled, not signalled
                await asyncio.sleep(0.005)
            else:
                await changed.wait()

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
                await self._step("drain", self.drain_timeout_s,
                                 tk.wait_until(lambda: tk.pending_prefills() == 0))
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
