"""The producer's generation clock and counters (pure accounting, a hand-driven clock)."""

from __future__ import annotations

import pytest

from pipeline.producer.stats import BusyClock, ProducerStats, tokens_per_busy_s


class Clock:
    """A time source the test advances by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_busy_time_counts_only_while_a_request_is_in_flight():
    clock = Clock()
    busy = BusyClock(clock)
    clock.t += 30.0  # engine start-up, waiting for the first version: not generation
    busy.enter()
    clock.t += 2.0
    busy.enter()  # a second request overlapping the first: the time is counted once
    clock.t += 1.0
    busy.exit()
    clock.t += 1.0
    assert busy.busy_s == pytest.approx(4.0)  # the interval under way counts
    busy.exit()
    clock.t += 50.0  # idle: waiting for the budget or a swap
    assert busy.busy_s == pytest.approx(4.0)
    busy.enter()
    clock.t += 6.0
    busy.exit()
    assert busy.busy_s == pytest.approx(10.0) and busy.in_flight == 0


def test_exit_without_enter_is_an_error():
    with pytest.raises(RuntimeError, match="without a matching enter"):
        BusyClock(Clock()).exit()


def test_gen_tokens_per_s_is_tokens_over_busy_seconds_not_over_the_process_lifetime():
    clock = Clock()
    stats = ProducerStats(busy=BusyClock(clock))
    assert stats.to_dict()["gen_tokens_per_s"] == 0.0  # nothing generated yet
    clock.t += 25.0  # engine start
    stats.busy.enter()
    clock.t += 2.0
    stats.busy.exit()
    stats.tokens += 1000
    clock.t += 60.0  # idle
    d = stats.to_dict()
    assert d["busy_s"] == pytest.approx(2.0)
    assert d["gen_tokens_per_s"] == pytest.approx(500.0)
    assert d["tokens"] == 1000.0 and all(type(v) is float for v in d.values())
    assert "busy" not in d


def test_tokens_per_busy_s_before_any_generation():
    assert tokens_per_busy_s(0, 0.0) == 0.0
    assert tokens_per_busy_s(10, 0.5) == 20.0
