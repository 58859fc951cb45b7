"""The suite's time budget: every test has one, and a run that goes over it fails.

Why: CI has 90 minutes and the suite must stay within 30 of them. A test's time is its setup,
call and teardown together (a module fixture's start-up counts for the test that first needs
it). Budgets are about twice a test's time on an idle 2-core machine, so they catch a test that
grew, never a busy moment: an end-to-end test (tests/e2e) gets ``E2E_S``, a unit test ``UNIT_S``,
and the few tests that need more are listed in ``OVER`` with their own budget and the reason.

``pytest --no-time-budget`` reports overruns without failing (a developer's loaded laptop).
"""

from __future__ import annotations

from dataclasses import dataclass

E2E_S = 90.0
UNIT_S = 5.0

# Test (file::function, parameters ignored) -> (budget in seconds, why it needs more).
OVER: dict[str, tuple[float, str]] = {}


@dataclass(frozen=True)
class Overrun:
    nodeid: str
    took_s: float
    budget_s: float


def _base(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def budget_for(nodeid: str) -> float:
    """The budget of a test by its pytest node id (``tests/e2e/test_x.py::test_y[param]``)."""
    listed = OVER.get(_base(nodeid))
    if listed is not None:
        return listed[0]
    return E2E_S if nodeid.startswith("tests/e2e/") else UNIT_S


def overruns(durations: dict[str, float]) -> list[Overrun]:
    """The tests that took longer than their budget, slowest first."""
    over = [Overrun(n, t, budget_for(n)) for n, t in durations.items() if t > budget_for(n)]
    return sorted(over, key=lambda o: -o.took_s)


def stale_entries(nodeids: set[str]) -> list[str]:
    """Entries of ``OVER`` that name no collected test (a renamed or merged test)."""
    bases = {_base(n) for n in nodeids}
    return sorted(k for k in OVER if k not in bases)
