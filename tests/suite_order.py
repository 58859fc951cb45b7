"""How ``scripts/test.sh`` spreads the suite over two pytest-xdist workers (``--dist loadgroup``).

Why: one end-to-end test alone leaves part of CI's two cores idle (a process waits on another);
two at a time fill them (89% busy over a whole run, BENCHMARKS.md), though not at half the
wall time: the suite is CPU-bound then. A group is what one worker runs in a row:
- every test of one file (module-scoped fixtures, e.g. a shared engine or Ray cluster, start once);
- every test marked ``ray``: their loopback clusters all put the head on 127.0.0.2, so they run
  one after another.
Groups are handed out costliest first (by their tests' time budgets), so the long end-to-end
files start at once and the many short unit tests fill the end; a test marked ``skip`` costs 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import time_budget


@dataclass(frozen=True)
class Entry:
    nodeid: str
    ray: bool = False
    skipped: bool = False


def group_of(entry: Entry) -> str:
    return "ray" if entry.ray else entry.nodeid.split("::", 1)[0]


def order(entries: Sequence[Entry]) -> list[int]:
    """Indices of ``entries`` in the order to collect them: groups by falling cost (ties: as
    collected), each group's tests in their collected order."""
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, e in enumerate(entries):
        g = group_of(e)
        first.setdefault(g, i)
        cost[g] = cost.get(g, 0.0) + (0.0 if e.skipped else time_budget.budget_for(e.nodeid))
    return sorted(range(len(entries)),
                  key=lambda i: (-cost[group_of(entries[i])], first[group_of(entries[i])], i))
