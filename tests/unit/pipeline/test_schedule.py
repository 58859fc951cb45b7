"""pipeline.schedule: the last version a run publishes, which versions are evaluated."""

from __future__ import annotations

from pipeline.schedule import engine_count, evaluator_index, is_due, last_version, skipped


def test_last_version_counts_publishes_before_the_final_step():
    assert last_version(6, 1) == 5  # steps 1..5 publish v1..v5; step 6 ends the run
    assert last_version(6, 2) == 2  # steps 2 and 4 publish
    assert last_version(1, 1) == 0  # nothing published: the base weights are the last


def test_due_every_kth_and_always_the_last():
    due = [v for v in range(8) if is_due(v, 3, 7)]
    assert due == [0, 3, 6, 7]
    assert not any(is_due(v, 0, 7) for v in range(8))  # off


def test_the_dedicated_evaluator_is_one_more_engine_after_the_producers():
    assert evaluator_index(2, 1, "dedicated") == 2 and engine_count(2, 1, "dedicated") == 3
    assert evaluator_index(2, 1, "shared") is None and engine_count(2, 1, "shared") == 2
    assert evaluator_index(2, 0, "dedicated") is None  # evaluation off: no evaluator


def test_skipped_counts_the_due_versions_an_evaluator_never_took():
    assert skipped(-1, 0, 2, 9) == 0  # the base model first: nothing before it
    assert skipped(0, 6, 2, 9) == 2  # v2 and v4 went by while v0 was evaluated
    assert skipped(6, 9, 2, 9) == 1  # v8; v9 (the last) is the one taken
    assert skipped(0, 9, 0, 9) == 0  # evaluation off
