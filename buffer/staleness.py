"""The staleness policy of a run, in one place: which groups are trainable, how many may be in
flight, and which versions each side must still be able to hold (pure functions, no state).

A group's staleness at train time is ``learner_version - policy_version``; ``max_staleness`` 0 is
on-policy. The rule is enforced twice, and both sides ask this module:

- producers admit a new group only while it can still be trained in time (``may_admit``, from
  the budget of ``admission_budget`` shared out by ``producer_budget``), and only while the run
  still needs it (``groups_to_go``: the batches of the steps the learner has not taken), so no
  generation is spent on a group the buffer must drop or that no step will train;
- the buffer drops, at consume time, every group that ``is_trainable`` refuses (the guarantee).

The versions kept follow from the same window: ``oldest_trainable`` for the buffer,
``oldest_kept`` for the learner's per-group checks (the window plus the snapshot files kept), and
``versions_in_flight`` for the producer's engine (the adapters it must hold at once).

It lives in ``buffer/`` so that the buffer can use it; ``pipeline/`` imports it from here.
"""

from __future__ import annotations


def oldest_trainable(learner_version: int, max_staleness: int) -> int:
    """The oldest policy_version the learner at ``learner_version`` may still train on."""
    return learner_version - max_staleness


def is_trainable(policy_version: int, learner_version: int, max_staleness: int) -> bool:
    """Whether a group of ``policy_version`` is within ``max_staleness`` of ``learner_version``."""
    return policy_version >= oldest_trainable(learner_version, max_staleness)


def oldest_kept(learner_version: int, max_staleness: int, keep_snapshots: int) -> int:
    """The oldest version a group's tokens may carry and still be accepted: the staleness window
    plus the snapshot files kept. A producer cannot honestly be further behind, as it loads only
    announced snapshots."""
    return max(0, learner_version - (max_staleness + keep_snapshots))


def versions_in_flight(max_staleness: int) -> int:
    """Policy versions one engine may run at once: requests of up to ``max_staleness`` + 1 older
    versions may still run beside the newest."""
    return max_staleness + 2


def admission_budget(batch_groups: int, max_staleness: int) -> int:
    """Groups that may be generated-or-buffered at once, all producers together.

    A group admitted while the engines hold version v is trained at the earliest at learner
    version v; with FIFO consumption it is trainable within ``max_staleness`` only if no more
    than (max_staleness + 1) batches are ahead of it.
    """
    return (max_staleness + 1) * batch_groups


def share(total: int, num_producers: int, index: int) -> int:
    """Producer ``index``'s share of ``total`` groups: shares differ by at most one, sum to
    ``total``, and each grows with ``total`` (so two limits shared out alike leave, summed, the
    smaller of the two totals)."""
    return total // num_producers + (1 if index < total % num_producers else 0)


def producer_budget(batch_groups: int, max_staleness: int, num_producers: int, index: int) -> int:
    """Producer ``index``'s share of the admission budget (shares differ by at most one)."""
    return share(admission_budget(batch_groups, max_staleness), num_producers, index)


def groups_to_go(last_step: int, steps_taken: int, batch_groups: int) -> int | None:
    """Groups the run still trains on: the batches of the steps the learner has not taken
    (``Announce.last_step`` and ``steps_taken``). None while no last step is told (no limit).

    Groups started beyond it would be generated and never trained: they would wait in the
    producers' outboxes at the end of the run.
    """
    if not last_step:
        return None
    return max(last_step - steps_taken, 0) * batch_groups


def may_admit(outstanding: int, batch_groups: int, max_staleness: int, num_producers: int,
              index: int, engine_version: int, learner_heading_to: int,
              to_go: int | None = None) -> bool:
    """Whether producer ``index`` may start one more group now.

    ``outstanding``: the producer's groups generating, in transit or in the learner's buffer;
    ``to_go``: ``groups_to_go`` (None: no limit), shared out as the budget is, so the producers
    together never start more than the remaining steps train, and never fewer while the
    learner waits (the smaller of the two totals is shared out in full).

    The learner trains the next batch at ``learner_heading_to`` (its version, plus one while it
    trains on a batch it has taken), the one after at +1, and so on. A group started on
    ``engine_version`` is trainable only within the batches up to ``max_staleness`` versions
    ahead of the engine, so the budget shrinks by the engine's lag behind the learner: a
    producer still on v while the learner trains towards v+1 would, with the whole budget,
    spend its engine on groups the buffer must drop (in sync mode, a batch per step).
    """
    lag = max(learner_heading_to - engine_version, 0)
    if lag > max_staleness:
        return False
    budget = producer_budget(batch_groups, max_staleness - lag, num_producers, index)
    if to_go is not None:
        budget = min(budget, share(to_go, num_producers, index))
    return outstanding < budget
