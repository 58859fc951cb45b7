"""buffer.staleness: the trainable window, the admission budget and its shares, the versions
kept; lock-step simulations check that admission starts no group the learner must drop, and,
told the run's last step, none that no step trains, while never leaving the learner short."""

from __future__ import annotations

import random

import pytest

from buffer.staleness import (
    admission_budget,
    groups_to_go,
    is_trainable,
    may_admit,
    oldest_kept,
    oldest_trainable,
    producer_budget,
    share,
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


def test_groups_to_go_counts_the_batches_of_the_steps_not_taken():
    assert groups_to_go(40, 0, 4) == 160
    assert groups_to_go(40, 39, 4) == 4    # the last batch is not taken yet
    assert groups_to_go(40, 40, 4) == 0    # taken: the run needs no more groups
    assert groups_to_go(0, 7, 4) is None   # a learner that tells no last step: no limit


def test_may_admit_stops_once_the_outstanding_groups_cover_the_last_step():
    def admit(outstanding, to_go, producers=1, index=0):
        return may_admit(outstanding, 4, 1, producers, index, 3, 3, to_go)

    assert admit(7, None) and not admit(8, None)   # the staleness budget alone: 2 batches
    assert admit(3, to_go=4) and not admit(4, to_go=4)
    assert not admit(0, to_go=0)
    # Two producers share the groups to go as they share the budget: 3 of 5 for p0, 2 for p1.
    assert [share(5, 2, k) for k in range(2)] == [3, 2]
    assert admit(2, to_go=5, producers=2, index=0) and not admit(3, 5, 2, 0)
    assert admit(1, to_go=5, producers=2, index=1) and not admit(2, 5, 2, 1)


def test_after_the_last_take_nothing_starts_so_the_last_swap_has_nothing_to_drain():
    """The demo (batch 4, max_staleness 1, 40 steps). Taking batch k < 40 raises heading_to to
    k, so a producer still on k-2 starts nothing until it has swapped. The last step publishes
    no version, so taking batch 40 leaves heading_to at 39: a producer still on 38 saw a lag of
    1 and started a batch for no step, whose prefills the swap to 39 then waited for."""
    assert not may_admit(0, 4, 1, 1, 0, engine_version=36, learner_heading_to=38)
    assert may_admit(0, 4, 1, 1, 0, engine_version=38, learner_heading_to=39)  # the budget alone
    assert not may_admit(0, 4, 1, 1, 0, 38, 39, to_go=groups_to_go(40, 40, 4))


def _run_to_the_end(steps: int, batch: int, max_staleness: int, producers: int,
                    tell_last_step: bool, seed: int = 0) -> tuple[int, list[int]]:
    """Pure-logic simulation of a whole run (no engines): producers, in a shuffled order, each
    start one group at a time while ``may_admit`` allows; groups finish at once and queue FIFO
    in the learner's buffer. The learner takes a batch per step (producers may admit while it
    trains), then every engine swaps to the version it publishes (none after the last step).
    Returns the groups generated and, per step, the groups the learner found when it took its
    batch (fewer than ``batch``: the run would stall)."""
    rng = random.Random(seed)
    buffered: list[int] = []  # the producer of each group in the buffer, FIFO
    learner = heading = taken = generated = 0
    found = []

    def admit() -> None:
        nonlocal generated
        to_go = groups_to_go(steps, taken, batch) if tell_last_step else None
        started = True
        while started:
            started = False
            for k in rng.sample(range(producers), producers):
                if may_admit(buffered.count(k), batch, max_staleness, producers, k, learner,
                             heading, to_go):
                    buffered.append(k)
                    generated += 1
                    started = True

    for step in range(1, steps + 1):
        admit()
        found.append(len(buffered))
        del buffered[:batch]
        taken += 1
        heading = learner + 1 if step < steps else learner
        admit()  # while the learner trains
        learner = heading
    return generated, found


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 4, 5])
def test_told_the_last_step_one_producer_generates_exactly_what_the_run_trains(max_staleness,
                                                                              batch):
    steps = 6
    generated, found = _run_to_the_end(steps, batch, max_staleness, 1, tell_last_step=True)
    assert generated == steps * batch
    assert min(found) >= batch  # and the learner never waits for a group nobody started
    # Without the last step, the run ends with groups generated for steps that never come.
    untold, _ = _run_to_the_end(steps, batch, max_staleness, 1, tell_last_step=False)
    assert untold > steps * batch


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("producers", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 4, 5, 8])
def test_told_the_last_step_several_producers_never_stall_and_leave_under_one_group_each(
        max_staleness, producers, batch):
    """Each producer stops at its share of the groups to go, counting its own groups only, so
    one holding more than its share when the shares shrink cannot hand the extra back."""
    steps = 8
    for seed in range(10):
        generated, found = _run_to_the_end(steps, batch, max_staleness, producers, True, seed)
        assert min(found) >= batch
        assert steps * batch <= generated < steps * batch + producers
