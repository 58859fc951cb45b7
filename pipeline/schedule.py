"""The run's version schedule, shared by the learner and the producers (pure functions): which
weights versions a run publishes, and which of them are evaluated.

Both sides must agree on it without asking each other: producer 0 evaluates exactly the due
versions, and the learner, once training is over, waits for the last version's evaluation only
when it is one of them.
"""

from __future__ import annotations


def last_version(steps: int, sync_every: int) -> int:
    """The last weights version a run publishes: one per ``sync_every`` steps, none after the
    final step (a step whose update was skipped as non-finite publishes nothing: then fewer)."""
    return max(steps - 1, 0) // sync_every


def is_due(version: int, every: int, last: int) -> bool:
    """Whether ``version`` is evaluated: every ``every``-th one (0 included: the base model),
    and always the last; never when evaluation is off (``every`` 0)."""
    return every > 0 and (version % every == 0 or version == last)
