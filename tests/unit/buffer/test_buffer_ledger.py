"""GroupLedger: each (incarnation, seq) is accepted once, whatever the arrival order."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from buffer.ledger import GroupLedger


def test_duplicates_are_refused_and_counted():
    led = GroupLedger()
    assert led.accept("p0-1", 0) and led.accept("p0-1", 1)
    assert not led.accept("p0-1", 0)
    assert led.accept("p0-2", 0)  # another incarnation is another stream
    assert led.duplicates == 1
    assert led.prefixes() == {"p0-1": 2, "p0-2": 1}


def test_prefix_waits_for_the_gap():
    led = GroupLedger()
    for seq in (0, 2, 3):
        led.accept("a", seq)
    assert led.prefixes() == {"a": 1}
    led.accept("a", 1)
    assert led.prefixes() == {"a": 4}


def test_round_trip_through_dict():
    led = GroupLedger()
    for seq in (0, 1, 5):
        led.accept("a", seq)
    led.accept("a", 5)
    back = GroupLedger.from_dict(led.to_dict())
    assert back.to_dict() == led.to_dict()
    assert not back.accept("a", 5) and back.accept("a", 2)


@given(st.lists(st.integers(min_value=0, max_value=60), max_size=200), st.integers(0, 2**32))
def test_any_arrival_order_accepts_each_seq_once(seqs, seed):
    led = GroupLedger()
    arrivals = seqs + seqs[: len(seqs) // 2]  # resends
    random.Random(seed).shuffle(arrivals)
    accepted = [s for s in arrivals if led.accept("x", s)]
    assert sorted(accepted) == sorted(set(seqs))
    assert led.duplicates == len(arrivals) - len(set(seqs))
    assert led.accepted("x") == set(seqs)
