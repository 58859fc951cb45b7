"""buffer.staleness: the trainable window, the admission budget and its shares, the versions
kept; a lock-step simulation checks that admission starts no group the learner must drop."""

from __future__ import annotations

import pytest

from buffer.staleness import (
    admission_budget,
    is_trainable,
    may_admit,
    oldest_kept,
    oldest_trainable,
    producer_budget,
    versions_in_flight,
)


def test_a_group_is_trainable_within_max_staleness_versions():
    assert oldest_trainable(5, 2) == 3
    assert is_trainable(3, 5, 2) and is_trainable(5, 5, 2)
    assert not is_trainable(2, 5, 2)
    assert is_trainable(5, 5, 0) and not is_trainable(4, 5, 0)  # on-policy


def test_oldest_kept_adds_the_snapshots_kept_and_stops_at_zero():
    assert oldest_kept(10, 1, 2) == 7
    assert oldest_kept(2, 1, 2) == 0


def test_versions_in_flight_covers_the_window_and_the_newest():
    assert versions_in_flight(0) == 2 and versions_in_flight(3) == 5


@pytest.mark.parametrize("batch_groups", [1, 4, 7, 8])
@pytest.mark.parametrize("max_staleness", [0, 1, 3])
@pytest.mark.parametrize("num_producers", [1, 2, 3, 5])
def test_producer_budget_shares_sum_to_budget(batch_groups, max_staleness, num_producers):
    total = admission_budget(batch_groups, max_staleness)
    assert total == (max_staleness + 1) * batch_groups
    shares = [producer_budget(batch_groups, max_staleness, num_producers, k)
              for k in range(num_producers)]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= 1


def test_may_admit_shrinks_the_budget_by_the_engines_lag():
    def admit(outstanding, staleness, engine, heading):
        return may_admit(outstanding, 16, staleness, 1, 0, engine, heading)

    assert admit(0, 0, engine=3, heading=3) and admit(15, 0, engine=3, heading=3)
    assert not admit(16, 0, engine=3, heading=3)
    # The learner took a batch and will publish v4: a group started on v3 would be dropped.
    assert not admit(0, 0, engine=3, heading=4)
    assert admit(15, 1, engine=3, heading=4) and not admit(16, 1, engine=3, heading=4)
    assert admit(31, 1, engine=4, heading=4)
    assert not admit(0, 1, engine=2, heading=4)


def _staleness_of_trained_groups(max_staleness: int, use_heading: bool) -> list[int]:
    """Pure-logic simulation (no engines) of one producer and a learner in lock-step: groups
    finish at once; the learner takes a batch, trains (the producer may admit meanwhile),
    publishes the next version, and the producer swaps to it. Returns each trained group's
    staleness (learner version at consumption - engine version at admission)."""
    batch = 4
    learner, engine, heading = 0, 0, 0
    buffered: list[int] = []  # admission versions of groups waiting in the buffer
    staleness = []

    def admit() -> None:
        while may_admit(len(buffered), batch, max_staleness, 1, 0, engine,
                        heading if use_heading else learner):
            buffered.append(engine)

    for _ in range(6):
        admit()
        taken, buffered[:] = buffered[:batch], buffered[batch:]
        staleness += [learner - v for v in taken]
        heading = learner + 1
        admit()  # while the learner trains
        learner = heading
        engine = learner  # the swap
    return staleness


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_admission_starts_no_group_the_learner_will_find_too_stale(max_staleness):
    assert max(_staleness_of_trained_groups(max_staleness, use_heading=True)) <= max_staleness
    # Without heading_to (the learner's version only), groups started while it trains end up
    # too stale: in sync mode a whole batch per step.
    assert max(_staleness_of_trained_groups(max_staleness, use_heading=False)) > max_staleness
