"""RolloutBuffer: counters, staleness, ordering, capacity, persistence, async waiting."""

from __future__ import annotations

import asyncio

import pytest
from buffer_factories import make_group
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer.schema import DecodeError
from buffer.store import BufferStats, RolloutBuffer


def _check_invariant(buf: RolloutBuffer) -> None:
    s = buf.stats
    assert s.received == s.served + s.dropped_stale + s.dropped_capacity + len(buf)
    assert s.size == len(buf) == sum(buf.held_by_producer().values())
    assert sum(s.age_histogram.values()) == s.served


def _ids(groups) -> list[str]:
    return [g.group_id for g in groups]


def test_put_take_fifo_and_counters():
    buf = RolloutBuffer(capacity=10, max_staleness=2)
    for i in range(5):
        assert buf.put(make_group(f"g{i}", version=i))
    assert len(buf) == 5 and buf.space() == 5
    assert buf.take(6, learner_version=2) is None
    assert len(buf) == 5  # nothing removed when short
    assert buf.take(6, learner_version=4) is None
    assert len(buf) == 3  # ...except stale groups, which are always dropped first
    assert _ids(buf.take(2, learner_version=4)) == ["g2", "g3"]  # g0, g1 too stale
    s = buf.stats
    assert (s.received, s.served, s.dropped_stale, s.size) == (5, 2, 2, 1)
    assert s.age_histogram == {2: 1, 1: 1}
    _check_invariant(buf)
    assert isinstance(s, BufferStats) and s.to_dict()["served"] == 2


def test_staleness_zero_is_on_policy_and_none_is_unlimited():
    buf = RolloutBuffer(capacity=10, max_staleness=0)
    buf.put(make_group("old", version=0))
    buf.put(make_group("new", version=1))
    assert _ids(buf.take(1, learner_version=1)) == ["new"]
    assert buf.stats.dropped_stale == 1
    unl = RolloutBuffer(capacity=10, max_staleness=None)
    unl.put(make_group("ancient", version=0))
    assert unl.drop_stale(10**6) == 0
    assert _ids(unl.take(1, learner_version=10**6)) == ["ancient"]


def test_mid_sequence_swap_uses_oldest_token_version():
    g = make_group("mixed", version=5)
    g.completions[0].version_segments = [(0, 3), (4, 5)]
    buf = RolloutBuffer(capacity=4, max_staleness=1)
    buf.put(g)
    assert buf.take(1, learner_version=5) is None  # 5 - 3 > 1
    assert buf.stats.dropped_stale == 1


def test_freshest_order():
    buf = RolloutBuffer(capacity=10, max_staleness=None, order="freshest")
    for i, v in enumerate([1, 3, 2, 3]):
        buf.put(make_group(f"g{i}", version=v))
    assert _ids(buf.take(3, learner_version=3)) == ["g3", "g1", "g2"]
    assert _ids(buf.take(1, learner_version=3)) == ["g0"]


def test_capacity_evicts_oldest_version_or_refuses_older_incoming():
    buf = RolloutBuffer(capacity=2, max_staleness=None)
    buf.put(make_group("a", version=1))
    buf.put(make_group("b", version=2))
    assert buf.put(make_group("c", version=3))  # evicts a (oldest version)
    assert _ids(buf.take(2, 3)) == ["b", "c"]
    buf.put(make_group("d", version=5))
    buf.put(make_group("e", version=5))
    assert not buf.put(make_group("old", version=0))  # older than everything: refused
    assert _ids(buf.take(2, 5)) == ["d", "e"]
    assert buf.stats.dropped_capacity == 2
    _check_invariant(buf)


def test_note_rejected_and_held_by_producer():
    buf = RolloutBuffer(capacity=10, max_staleness=None)
    buf.put(make_group("a", producer_id="p0"))
    buf.put(make_group("b", producer_id="p1"))
    buf.put(make_group("c", producer_id="p1"))
    buf.note_rejected(3)
    assert buf.held_by_producer() == {"p0": 1, "p1": 2}
    assert buf.stats.rejected == 3
    _check_invariant(buf)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="capacity"):
        RolloutBuffer(0, None)
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(1, -1)
    with pytest.raises(ValueError, match="order"):
        RolloutBuffer(1, None, order="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_groups"):
        RolloutBuffer(1, None).take(0, 0)


def test_snapshot_restore_round_trip():
    buf = RolloutBuffer(capacity=4, max_staleness=1)
    for i in range(6):
        buf.put(make_group(f"g{i}", version=i, producer_id=f"p{i % 2}"))
    buf.take(1, learner_version=5)
    buf.note_rejected(2)
    data = buf.snapshot()
    back = RolloutBuffer.restore(data, capacity=4, max_staleness=1, order="fifo")
    assert back.stats == buf.stats
    assert back.held_by_producer() == buf.held_by_producer()
    assert back.take(len(buf), 5) == buf.take(len(buf), 5)
    # Restoring into a smaller buffer evicts, and still keeps the books balanced.
    small = RolloutBuffer.restore(data, capacity=1, max_staleness=None, order="freshest")
    assert len(small) == 1
    _check_invariant(small)
    with pytest.raises(DecodeError):
        RolloutBuffer.restore(b"\x00garbage", 4, None, "fifo")


def test_get_batch_waits_for_put_and_times_out():
    async def main():
        buf = RolloutBuffer(capacity=8, max_staleness=0)

        async def feed():
            for i in range(3):
                await asyncio.sleep(0.01)
                buf.put(make_group(f"g{i}", version=2))

        feeder = asyncio.create_task(feed())
        batch = await buf.get_batch(3, learner_version=2, timeout=5)
        await feeder
        assert _ids(batch) == ["g0", "g1", "g2"]
        buf.put(make_group("stale", version=0))
        with pytest.raises(TimeoutError, match=r"timed out after 0.05 s waiting for 2 groups"):
            await buf.get_batch(2, learner_version=2, timeout=0.05)
        assert buf.stats.dropped_stale == 1
        with pytest.raises(ValueError, match="never be satisfied"):
            await buf.get_batch(9, learner_version=2, timeout=1)

    asyncio.run(main())


def test_wait_for_space():
    async def main():
        buf = RolloutBuffer(capacity=1, max_staleness=None)
        await buf.wait_for_space(timeout=0)  # already has space
        buf.put(make_group("a"))
        with pytest.raises(TimeoutError, match="still full"):
            await buf.wait_for_space(timeout=0.02)
        waiter = asyncio.create_task(buf.wait_for_space(timeout=5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        buf.take(1, 0)
        await waiter

    asyncio.run(main())
    asyncio.run(main())  # fresh loop: no state bound to the first one


class BufferMachine(RuleBasedStateMachine):
    """Random puts/takes/drops; the books must balance after every step."""

    def __init__(self):
        super().__init__()
        self.max_staleness = 2
        self.buf = RolloutBuffer(capacity=6, max_staleness=self.max_staleness,
                                 order="freshest" if id(self) % 2 else "fifo")
        self.learner_version = 0
        self.n = 0
        self.sizes: dict[str, int] = {}
        self.seen: set[str] = set()

    @rule(lag=st.integers(0, 4), n_completions=st.integers(1, 3))
    def put(self, lag, n_completions):
        gid = f"g{self.n}"
        self.n += 1
        self.sizes[gid] = n_completions
        self.buf.put(make_group(gid, version=max(0, self.learner_version - lag),
                                n_completions=n_completions, n_tokens=2))

    @rule(n=st.integers(1, 4))
    def take(self, n):
        before = len(self.buf)
        batch = self.buf.take(n, self.learner_version)
        if batch is None:
            assert len(self.buf) <= before and len(self.buf) < n
            return
        assert len(batch) == n
        for g in batch:
            assert len(g.completions) == self.sizes[g.group_id]  # never split
            assert self.learner_version - g.policy_version <= self.max_staleness
            assert g.group_id not in self.seen  # never served twice
            self.seen.add(g.group_id)

    @rule()
    def advance(self):
        self.learner_version += 1

    @precondition(lambda self: len(self.buf) > 0)
    @rule()
    def drop(self):
        self.buf.drop_stale(self.learner_version)

    @invariant()
    def books_balance(self):
        _check_invariant(self.buf)
        assert len(self.buf) <= 6


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
