"""pipeline.schedule: the last version a run publishes, which versions are evaluated."""

from __future__ import annotations

from pipeline.schedule import is_due, last_version


def test_last_version_counts_publishes_before_the_final_step():
    assert last_version(6, 1) == 5  # steps 1..5 publish v1..v5; step 6 ends the run
    assert last_version(6, 2) == 2  # steps 2 and 4 publish
    assert last_version(1, 1) == 0  # nothing published: the base weights are the last


def test_due_every_kth_and_always_the_last():
    due = [v for v in range(8) if is_due(v, 3, 7)]
    assert due == [0, 3, 6, 7]
    assert not any(is_due(v, 0, 7) for v in range(8))  # off
