"""Which producers the learner listens to (pure logic, no sockets).

A producer says Hello on the control channel before anything else; the registry records its
incarnation (one producer process) and the dead incarnations whose unconfirmed groups it resends.
Only the run's producer ids (and its evaluators', which run held-out prompts and never send
groups) may say Hello. Every later message is checked against that record:

- a control message (Heartbeat, Ack, SyncReady) must come from a known producer id and carry
  its current incarnation;
- a rollout group must carry ``metadata["incarnation"]`` (str) and ``metadata["seq"]`` (int
  >= 0), from a known producer, with an incarnation recorded for it (so the exactly-once ledger
  can place every group it accepts), and never from an evaluator.

Anything else is refused with a reason; the caller counts it (``rejected/<reason>``) and the
registry logs it once per producer and reason, so a flood of forgeries cannot flood the log.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from buffer.protocol import Hello
from buffer.schema import RolloutGroup

log = logging.getLogger(__name__)

UNKNOWN_PRODUCER = "unknown_producer"
"""No Hello from this producer id (a forgery, or a learner restarted since its Hello)."""
STALE_INCARNATION = "stale_incarnation"
"""A control message from an incarnation that a newer Hello of the same producer id replaced."""
UNKNOWN_INCARNATION = "unknown_incarnation"
"""A group whose incarnation its producer never declared."""
UNEXPECTED_PRODUCER = "unexpected_producer"
"""A Hello with a producer id this run does not have (p0 .. p<num_producers - 1>)."""
FROM_EVALUATOR = "from_evaluator"
"""A group from an evaluator: it sends evaluation figures, never rollout groups."""
NO_METADATA = "no_metadata"
"""A group without a str ``incarnation`` and an int ``seq`` >= 0 in its metadata."""


@dataclass
class ProducerIdentity:
    incarnation: str
    """The live process: control messages must carry it."""
    incarnations: set[str] = field(default_factory=set)
    """Every incarnation whose groups are accepted from this producer id (the live one, earlier
    ones whose logs it resends, and earlier live ones still draining from the socket)."""


class ProducerRegistry:
    def __init__(self, expected: set[str] | None = None,
                 evaluators: frozenset[str] = frozenset()) -> None:
        """``expected``: the producer ids this run has (None: any id may say Hello);
        ``evaluators``: the ids of its evaluators, who may say Hello but send no groups."""
        self.expected = expected
        self.evaluators = evaluators
        self.producers: dict[str, ProducerIdentity] = {}
        self.rejected: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()

    def check_hello(self, msg: Hello) -> str | None:
        """None if ``msg`` may introduce its producer, else why not."""
        if self.expected is not None and msg.producer_id not in self.expected | self.evaluators:
            return UNEXPECTED_PRODUCER
        return None

    def hello(self, msg: Hello) -> bool:
        """Record ``msg``'s incarnation; True if it is new for its producer id (a restart)."""
        known = self.producers.get(msg.producer_id)
        if known is None:
            known = self.producers[msg.producer_id] = ProducerIdentity(msg.incarnation)
            new = True
        else:
            new = known.incarnation != msg.incarnation
            known.incarnation = msg.incarnation
        known.incarnations.update((msg.incarnation, *msg.recovered))
        self._logged = {k for k in self._logged if k[0] != msg.producer_id}
        return new

    def check_control(self, producer_id: str, incarnation: str) -> str | None:
        """None if a control message from (producer_id, incarnation) is accepted, else why not."""
        known = self.producers.get(producer_id)
        if known is None:
            return UNKNOWN_PRODUCER
        if known.incarnation != incarnation:
            return STALE_INCARNATION
        return None

    def check_group(self, group: RolloutGroup) -> str | None:
        """None if ``group`` may enter the buffer, else why not."""
        inc, seq = group.metadata.get("incarnation"), group.metadata.get("seq")
        if type(inc) is not str or type(seq) is not int or seq < 0:
            return NO_METADATA
        if group.producer_id in self.evaluators:
            return FROM_EVALUATOR
        known = self.producers.get(group.producer_id)
        if known is None:
            return UNKNOWN_PRODUCER
        if inc not in known.incarnations:
            return UNKNOWN_INCARNATION
        return None

    def reject(self, reason: str, producer_id: str, what: str) -> None:
        """Count one refused frame; log the first of each (producer, reason)."""
        self.rejected[reason] += 1
        key = (producer_id, reason)
        if key not in self._logged:
            self._logged.add(key)
            log.warning(
                "rejected %s from producer %r: %s (further ones are only counted, as rejected/%s)",
                what,
                producer_id,
                reason,
                reason,
            )

    def metrics(self) -> dict[str, float]:
        return {f"rejected/{k}": float(v) for k, v in sorted(self.rejected.items())}
