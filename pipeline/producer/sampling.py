"""Dynamic sampling (DAPO): which scored groups a producer drops as uninformative before it sends
them, and the cap on those drops per learner step (pure logic, no engine or socket).

A GRPO group whose G rewards are all equal has zero advantage: the learner would pay a forward
and backward for it and learn nothing (it zeroes such groups, ``degenerate_frac``). With
``generation.dynamic_sampling`` the producer drops it once scored instead, counts it
(``groups_dropped_zero_variance``) and logs it in its sent log, so conservation stays exact:
every group whose generation ended is sent, or dropped under one named reason.

Invariants:
- A dropped group never enters the learner's buffer. It held one slot of the producer's
  admission budget while it generated; that slot frees when it ends, and the group admitted in
  its place is checked by ``buffer.staleness.may_admit`` at the engine's lag of that moment, like
  any other. The groups ahead of a new admission in the learner's FIFO are therefore still at
  most the budget, and the staleness bound holds unchanged: a replacement is trainable in time
  or it is not admitted. The budget stays a hard count of groups that may be generating or
  waiting, never an expected count of informative ones (admitting more in the hope that some
  will be dropped starts groups that come out too stale when they are not).
- Drops are capped per learner step (``DropCap``): at most ``extra_cap`` groups per producer
  between two batches the learner takes, a multiple (``generation.dynamic_sampling_max_extra``)
  of the producer's share of one batch. Past it the producer sends the step's groups as they
  are (they train with zero advantage), so a prompt set the policy has solved cannot keep the
  engines generating groups nobody trains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from buffer.staleness import producer_budget


def reward_std(rewards: Sequence[float]) -> float:
    """The sample (Bessel-corrected) standard deviation of a group's rewards, as the loss's
    advantage scaling computes it; 0 for a group of fewer than two."""
    n = len(rewards)
    if n < 2:
        return 0.0
    mean = sum(rewards) / n
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))


def is_uninformative(rewards: Sequence[float], min_std: float = 0.0) -> bool:
    """Whether a scored group teaches GRPO nothing: all its rewards equal (exactly, as the
    learner's ``degenerate_mask`` tests it), or, with ``min_std`` > 0, their std below it."""
    if not rewards or max(rewards) == min(rewards):
        return True
    return min_std > 0 and reward_std(rewards) < min_std


def extra_cap(batch_groups: int, max_extra: float, num_producers: int, index: int) -> int:
    """Groups producer ``index`` may drop per learner step: ``max_extra`` times its share of one
    batch (at least one group's worth, for a producer whose share is empty), rounded up."""
    share = producer_budget(batch_groups, 0, num_producers, index)
    return math.ceil(max_extra * max(share, 1))


class DropCap:
    """Counts a producer's drops per learner step and says when the cap is reached.

    ``window`` identifies the learner step the producer is filling: any number that changes when
    the learner takes a batch (the producer passes the groups the learner has consumed, from the
    Announce). The count starts again at each new window."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"the drop cap must be >= 1, got {cap}")
        self.cap = cap
        self.window: int | None = None
        self.dropped = 0           # drops in the current window
        self.capped_windows = 0    # windows in which the cap was reached (groups sent as they are)
        self._capped = False

    def drop(self, window: int) -> bool:
        """Whether one more uninformative group may be dropped in ``window`` (counted if so).
        False once the window's cap is spent: that group and the window's later ones are sent."""
        if window != self.window:
            self.window, self.dropped, self._capped = window, 0, False
        if self.dropped < self.cap:
            self.dropped += 1
            return True
        if not self._capped:
            self._capped = True
            self.capped_windows += 1
        return False
