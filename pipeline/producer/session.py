"""A producer process's side of the control channel, shared by the producers
(``pipeline.producer.loop``) and the dedicated evaluator (``pipeline.producer.evaluation``).

Its Hello is repeated until the learner welcomes it. Each later request gets its answer; a
learner that no longer knows this process (it restarted, or another process said Hello in its
name) gets the Hello again, then the request once more. The process's coroutines run
together until the learner finishes or the producer leaves (``run_tasks``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from buffer.identity import STALE_INCARNATION, UNEXPECTED_PRODUCER, UNKNOWN_PRODUCER
from buffer.protocol import ControlMessage, Hello, Reply, Welcome

log = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 5.0  # the learner answers control requests at once; longer means it is down
RECANCEL_S = 1.0  # a task still running this long after its cancel is cancelled again


class LearnerFinished(Exception):
    """The learner announced its end (all steps trained): the process's run is over."""


class ProducerLeft(Exception):
    """The producer left an elastic run (``Producer._leave``): its process ends, exit code 0."""


class LearnerSession:
    def __init__(self, endpoint: Any, make_hello: Callable[[], Hello], refused: str) -> None:
        """``make_hello``: this process's Hello as of now (its version, GPUs, recovered logs);
        ``refused``: the error when the learner's run has no such process."""
        self.endpoint, self.make_hello, self.refused = endpoint, make_hello, refused

    async def hello(self) -> None:
        """Introduce this process; returns once the learner has welcomed it (retrying while
        the learner is not up yet)."""
        hello = self.make_hello()
        waited = 0.0
        while True:
            answer = await self.endpoint.call(hello, CONTROL_TIMEOUT_S)
            if isinstance(answer, Welcome):
                return
            if isinstance(answer, Reply) and answer.reason == UNEXPECTED_PRODUCER:
                raise RuntimeError(self.refused)
            waited += CONTROL_TIMEOUT_S
            log.info("%s: no welcome from the learner after %.0f s (%s); saying Hello again",
                     hello.producer_id, waited, answer.reason if answer else "no answer")

    async def call(self, msg: ControlMessage) -> Reply | None:
        """One control request: its answer, or None when the learner did not answer."""
        answer = await self.endpoint.call(msg, CONTROL_TIMEOUT_S)
        if isinstance(answer, Reply) and answer.reason in (UNKNOWN_PRODUCER, STALE_INCARNATION):
            log.warning("%s: the learner refused a %s (%s); saying Hello again",
                        msg.producer_id, type(msg).__name__, answer.reason)
            await self.hello()
            answer = await self.endpoint.call(msg, CONTROL_TIMEOUT_S)
        return answer if isinstance(answer, Reply) else None


async def run_tasks(who: str, tasks: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``tasks`` together until one raises, then cancel the others and wait for them: the
    learner's end and a clean leave end the run with one console line, anything else is raised.

    A cancel can be lost in Python 3.11 (``asyncio.wait_for`` returns the inner result when the
    cancel lands as it completes; a swap runs several of them), and a task that lost it would keep
    the process running after its end, as a producer that left and went on swapping weights for
    good. So a task still running ``RECANCEL_S`` after its cancel is cancelled again."""
    running = [asyncio.ensure_future(t) for t in tasks]
    try:
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        await cancel_all(running)
    errors = [e for t in running if t in done and not t.cancelled()
              and (e := t.exception()) is not None]
    first = next((e for e in errors if not isinstance(e, (LearnerFinished, ProducerLeft))),
                 errors[0] if errors else None)
    if isinstance(first, LearnerFinished):
        log.info("%s: %s; stopping", who, first)
    elif isinstance(first, ProducerLeft):
        log.info("%s: %s", who, first)
    elif first is not None:
        raise first


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again any that goes on."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for t in tasks:  # retrieved, so asyncio does not log them as never retrieved
        if not t.cancelled():
            t.exception()
