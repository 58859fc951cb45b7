"""The suite's time budget (tests/time_budget.py): which tests are over it."""

from __future__ import annotations

import time_budget


def test_default_budgets_by_folder_and_listed_exceptions(monkeypatch):
    monkeypatch.setattr(time_budget, "OVER", {"tests/e2e/test_a.py::test_big": (200.0, "why")})
    assert time_budget.budget_for("tests/unit/x/test_b.py::test_c") == time_budget.UNIT_S
    assert time_budget.budget_for("tests/e2e/test_a.py::test_other") == time_budget.E2E_S
    assert time_budget.budget_for("tests/e2e/test_a.py::test_big[sync-2]") == 200.0


def test_overruns_are_the_tests_over_their_budget_slowest_first(monkeypatch):
    monkeypatch.setattr(time_budget, "OVER", {"tests/e2e/test_a.py::test_big": (200.0, "why")})
    took = {"tests/unit/test_u.py::test_fast": 0.2, "tests/unit/test_u.py::test_slow": 6.0,
            "tests/e2e/test_a.py::test_big": 150.0, "tests/e2e/test_a.py::test_run": 150.0}
    over = time_budget.overruns(took)
    assert [(o.nodeid, o.budget_s) for o in over] == [
        ("tests/e2e/test_a.py::test_run", time_budget.E2E_S),
        ("tests/unit/test_u.py::test_slow", time_budget.UNIT_S)]


def test_a_listed_test_that_no_longer_exists_is_reported(monkeypatch):
    monkeypatch.setattr(time_budget, "OVER", {"tests/e2e/test_a.py::test_gone": (200.0, "why"),
                                              "tests/e2e/test_a.py::test_big": (200.0, "why")})
    assert time_budget.stale_entries({"tests/e2e/test_a.py::test_big[p]"}) == [
        "tests/e2e/test_a.py::test_gone"]


def test_every_listed_budget_gives_its_reason():
    for name, (budget, reason) in time_budget.OVER.items():
        default = time_budget.E2E_S if name.startswith("tests/e2e/") else time_budget.UNIT_S
        assert budget > default and len(reason) > 10, name


def test_a_budget_is_shared_by_the_tests_running_at_once(monkeypatch):
    monkeypatch.setattr(time_budget, "OVER", {})
    took = {"tests/e2e/test_a.py::test_run@tests/e2e/test_a.py": 150.0}
    assert [o.budget_s for o in time_budget.overruns(took)] == [time_budget.E2E_S]
    assert time_budget.overruns(took, share=2) == []


def test_the_xdist_group_suffix_is_not_part_of_the_name(monkeypatch):
    monkeypatch.setattr(time_budget, "OVER", {"tests/e2e/test_a.py::test_big": (200.0, "why")})
    assert time_budget.budget_for("tests/e2e/test_a.py::test_big[p]@ray") == 200.0
    assert time_budget.stale_entries({"tests/e2e/test_a.py::test_big@tests/e2e/test_a.py"}) == []


def test_over_the_wall_budget_fails_only_with_the_cpu_budget_or_far_over(monkeypatch):
    """A test slowed by the machine (its CPU seconds within budget) does not fail the run; one
    that does more work, or waits three times its budget, does."""
    monkeypatch.setattr(time_budget, "OVER", {})
    u = "tests/unit/test_u.py::test_"
    took = {u + "slowed": 8.0, u + "grew": 8.0, u + "waits": 16.0, u + "unknown": 8.0}
    cpu = {u + "slowed": 2.0, u + "grew": 7.0, u + "waits": 0.1}
    assert [o.nodeid for o in time_budget.overruns(took, 1, cpu)] == [
        u + "waits", u + "grew", u + "unknown"]
    assert [(o.nodeid, o.cpu_s) for o in time_budget.slowed(took, 1, cpu)] == [
        (u + "slowed", 2.0)]
    assert time_budget.overruns({u + "slowed": 8.0}, 2, cpu) == []  # 5 s x 2 workers
