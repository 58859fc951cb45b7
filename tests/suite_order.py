"""How ``scripts/test.sh`` spreads the suite over two pytest-xdist workers (``--dist loadgroup``).

Why: one end-to-end test alone leaves part of CI's two cores idle (a process waits on another);
two at a time fill them (89% busy over a whole run, BENCHMARKS.md), though not at half the
wall time: the suite is CPU-bound then. A group is what one worker runs in a row:
- every test of one file (module-scoped fixtures, e.g. a shared engine or Ray cluster, start once);
- every test marked ``ray``: their loopback clusters all put the head on 127.0.0.2, so they run
  one after another.
Groups are handed out costliest first (by their tests' time budgets), so the long end-to-end
files start at once and the many short unit tests fill the end; a test marked ``skip`` costs 0.

Except the groups with a test marked ``exclusive`` (it holds the machine alone,
``tests/machine_share.py``): they go first, followed by half the unit tests' groups (by cost),
which take no hold on the machine. So while the exclusive test runs, the other worker runs unit
tests; handed out mid-run, its end-to-end test would wait idle for the machine (111 s of a
worker in a run measured here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import machine_share
import time_budget


@dataclass(frozen=True)
class Entry:
    nodeid: str
    ray: bool = False
    skipped: bool = False
    exclusive: bool = False


def group_of(entry: Entry) -> str:
    return "ray" if entry.ray else entry.nodeid.split("::", 1)[0]


def order(entries: Sequence[Entry]) -> list[int]:
    """Indices of ``entries`` in the order to collect them: the exclusive groups, then unit-test
    groups making half the unit tests' cost, then the rest; each part's groups by falling cost
    (ties: as collected), each group's tests in their collected order."""
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    exclusive: set[str] = set()
    holds: set[str] = set()
    for i, e in enumerate(entries):
        g = group_of(e)
        first.setdefault(g, i)
        cost[g] = cost.get(g, 0.0) + (0.0 if e.skipped else time_budget.budget_for(e.nodeid))
        if e.exclusive and not e.skipped:
            exclusive.add(g)
        if machine_share.holds_machine(e.nodeid):
            holds.add(g)
    by_cost = sorted(cost, key=lambda g: (-cost[g], first[g]))
    part = {g: 0 for g in exclusive}
    if exclusive:
        free = [g for g in by_cost if g not in holds]
        half, taken = sum(cost[g] for g in free) / 2, 0.0
        for g in free:
            if taken >= half:
                break
            part[g], taken = 1, taken + cost[g]
    rank = {g: (part.get(g, 2), k) for k, g in enumerate(by_cost)}
    return sorted(range(len(entries)), key=lambda i: (rank[group_of(entries[i])], i))
