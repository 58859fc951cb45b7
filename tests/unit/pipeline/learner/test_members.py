"""The learner's members of an elastic run (pure logic)."""

from __future__ import annotations

from pipeline.learner.producers import Members


def test_the_run_starts_with_its_producers_and_follows_joins_and_leaves():
    m = Members(2)
    assert list(m) == ["p0", "p1"] and "p1" in m  # members before their Hello
    assert m.join("p10") and not m.join("p1")  # a restarted producer keeps its place
    assert list(m) == ["p0", "p1", "p10"]  # index order, not text order
    assert m.leave("p0") and not m.leave("p0")
    assert list(m) == ["p1", "p10"] and len(m) == 2 and "p0" not in m
    assert str(m) == "2 producers (p1, p10)"
    m.leave("p10")
    assert str(m) == "1 producer (p1)"
