"""A producer process's side of the control channel, shared by the producers
(``pipeline.producer.loop``) and the dedicated evaluator (``pipeline.producer.evaluator``).

Its Hello is repeated until the learner welcomes it. Each later request gets its answer; a
learner that no longer knows this process (it restarted, or another process said Hello in its
name) gets the Hello again, then the request once more. The process's coroutines run under
one TaskGroup until the learner finishes or the producer leaves (``run_tasks``).
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
    """Run ``tasks`` together until one raises (then the others are cancelled): the learner's
    end and a clean leave end the run with one console line, anything else propagates."""
    try:
        async with asyncio.TaskGroup() as tg:
            for task in tasks:
                tg.create_task(task)
    except* LearnerFinished as eg:
        log.info("%s: %s; stopping", who, eg.exceptions[0])
    except* ProducerLeft as eg:
        log.info("%s: %s", who, eg.exceptions[0])
