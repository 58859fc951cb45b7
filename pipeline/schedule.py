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


def skipped(previous: int, version: int, every: int, last: int) -> int:
    """The due versions strictly between ``previous`` and ``version``: those an evaluator that
    took ``version`` right after ``previous`` never evaluated (announced and superseded while
    it was busy)."""
    return sum(1 for v in range(previous + 1, version) if is_due(v, every, last))


EVALUATOR_ID = "eval"
"""The dedicated evaluator's id on the control channel (never a producer's: those are p<i>)."""


def evaluator_index(producer_slots: int, every: int, producer: str) -> int | None:
    """The dedicated evaluator's launch index, after every producer index the run may use
    (``RunConfig.producer_slots``; ``eval.producer`` 'dedicated' with evaluation on), or None:
    producer 0 evaluates, or nobody does."""
    return producer_slots if every > 0 and producer == "dedicated" else None


def engine_count(producer_slots: int, every: int, producer: str) -> int:
    """The engines a run may have at once: its producers' and the dedicated evaluator's."""
    return producer_slots + (evaluator_index(producer_slots, every, producer) is not None)


def is_evaluator(cfg_dict: dict, index: int) -> bool:
    """Whether engine ``index`` of the run (``cfg_dict``: its config as a dict) is the dedicated
    evaluator, which the launchers start after the producers."""
    ev = cfg_dict["eval"]
    slots = max(cfg_dict["num_producers"], cfg_dict.get("max_producers", 0))
    return index == evaluator_index(slots, ev["every"], ev["producer"])


def process_name(cfg_dict: dict, index: int) -> str:
    """Engine ``index``'s process name: its log file is ``logs/<name>.log``."""
    return "evaluator" if is_evaluator(cfg_dict, index) else f"producer-{index}"


def display_name(cfg_dict: dict, index: int) -> str:
    """Engine ``index`` as console lines say it: "producer 1", "evaluator"."""
    return process_name(cfg_dict, index).replace("-", " ")
