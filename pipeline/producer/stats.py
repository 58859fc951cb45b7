"""A producer's counters and its generation clock: what its heartbeats carry to the learner.

Invariants:
- Every counter only grows during the life of the producer process (the learner carries a
  restarted producer's earlier counts over, see ``pipeline.learner.metrics.carry_counters``);
  the only rate, ``gen_tokens_per_s``, ends in ``_per_s`` (rates are never carried over).
- ``busy_s`` counts the seconds during which the engine had at least one request in flight,
  whatever the number of requests: ``gen_tokens_per_s`` = tokens / busy_s is the engine's rate
  while it was generating, not diluted by engine start-up or by waits for the budget or a
  version (idle time), nor by reward scoring after the last request of a batch finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


class BusyClock:
    """Seconds with at least one request in flight: ``enter`` when a request starts, ``exit``
    when it ends (each ``enter`` matched by one ``exit``). Pure accounting; the time source is
    injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_flight = 0
        self._closed_s = 0.0  # busy seconds of the intervals already ended
        self._since: float | None = None  # start of the interval under way

    def enter(self) -> None:
        if self.in_flight == 0:
            self._since = self._clock()
        self.in_flight += 1

    def exit(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("BusyClock.exit without a matching enter")
        self.in_flight -= 1
        if self.in_flight == 0 and self._since is not None:
            self._closed_s += self._clock() - self._since
            self._since = None

    @property
    def busy_s(self) -> float:
        """Busy seconds so far, the interval under way included."""
        if self._since is None:
            return self._closed_s
        return self._closed_s + self._clock() - self._since


def tokens_per_busy_s(tokens: int, busy_s: float) -> float:
    """Generation rate over busy time (0 before any generation)."""
    return tokens / busy_s if busy_s > 0 else 0.0


@dataclass
class ProducerStats:
    """Counters of one producer process (the heartbeat's ``stats``, with the reward counters)."""

    groups_started: int = 0
    groups_sent: int = 0
    groups_dropped_reward: int = 0
    # generation.dynamic_sampling: groups dropped as uninformative (all rewards equal, or their
    # std below the threshold), and learner steps in which the drop cap was reached.
    groups_dropped_zero_variance: int = 0
    # groups whose tokens went back in version (begun before a learner restart to an older
    # checkpoint, finished after it): not sent.
    groups_dropped_restart: int = 0
    dynamic_sampling_cap_hits: int = 0
    prompts_skipped_too_long: int = 0
    completions_resubmitted: int = 0
    groups_resent: int = 0
    retention_overflow: int = 0
    tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished requests (an episode turn's transcript)
    prompt_tokens_cached: int = 0  # of those, served from vLLM's prefix cache
    swaps: int = 0
    swap_failures: int = 0
    transport_fallbacks: int = 0
    sleeps: int = 0
    # Multi-turn episodes (episode.fn): turns, tool calls, environment tokens, and each kind of
    # failure (a tool raised or hung, the episode timed out or raised), plus the groups dropped
    # for one under rewards.on_failure=drop.
    episodes: int = 0
    episode_turns: int = 0
    episode_tool_calls: int = 0
    episode_env_tokens: int = 0
    episode_tool_timeouts: int = 0
    episode_tool_errors: int = 0
    episode_timeouts: int = 0
    episode_errors: int = 0
    groups_dropped_episode: int = 0
    sleep_s: float = 0.0  # seconds spent putting the engine to sleep (engine.sleep_when_idle)
    wake_s: float = 0.0  # and waking it up again
    busy: BusyClock = field(default_factory=BusyClock)

    def to_dict(self) -> dict[str, float]:
        d = {k: float(v) for k, v in self.__dict__.items() if k != "busy"}
        d["busy_s"] = self.busy.busy_s
        d["gen_tokens_per_s"] = tokens_per_busy_s(self.tokens, d["busy_s"])
        return d
