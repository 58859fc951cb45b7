"""A completion begun before a learner restart to an older checkpoint and finished after it has
version runs that go back (54 then 45): its group is dropped, not sent (the schema refuses it, and
the producer would die on it). Pure logic: the segment check."""

from __future__ import annotations

from pipeline.producer.group import versions_go_back


def test_runs_that_go_back_in_version_are_told_apart():
    assert versions_go_back([(0, 54), (3, 45)])
    assert versions_go_back([(0, 3), (2, 4), (5, 2)])
    assert not versions_go_back([(0, 3)])
    assert not versions_go_back([(0, 3), (4, 3), (6, 5)])
    assert not versions_go_back([])
