"""``run_tasks``: the producer's coroutines end together, even when one of them loses the cancel
(Python 3.11's ``asyncio.wait_for`` can return the inner result when a cancel lands as it
completes: a producer that left went on swapping weights for good)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pipeline.producer import session
from pipeline.producer.session import LearnerFinished, ProducerLeft, run_tasks


async def _loses_first_cancel(ticks: list[int]) -> None:
    """Swallows the first cancel, as a cancel lost by wait_for, then runs until cancelled."""
    lost = False
    while True:
        try:
            await asyncio.sleep(0.01)
            ticks.append(1)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True


async def _raises_after(exc: BaseException, s: float = 0.05) -> None:
    await asyncio.sleep(s)
    raise exc


def test_a_task_that_lost_its_cancel_is_cancelled_again(monkeypatch, caplog):
    monkeypatch.setattr(session, "RECANCEL_S", 0.1)
    ticks: list[int] = []

    async def main() -> None:
        await asyncio.wait_for(run_tasks("p0", [
            _loses_first_cancel(ticks), _raises_after(ProducerLeft("left the run after 3"))]), 10)

    with caplog.at_level(logging.INFO, logger=session.log.name):
        asyncio.run(main())
    assert "p0: left the run after 3" in caplog.text
    n = len(ticks)
    assert n > 0  # it ran, and once run_tasks returned nothing of it runs any more
    asyncio.run(asyncio.sleep(0.05))
    assert len(ticks) == n


def test_the_learners_end_is_one_line_and_other_errors_are_raised_as_they_are(caplog):
    async def forever() -> None:
        await asyncio.Event().wait()

    with caplog.at_level(logging.INFO, logger=session.log.name):
        asyncio.run(run_tasks("p1", [forever(), _raises_after(LearnerFinished("trained v9"))]))
    assert "p1: trained v9; stopping" in caplog.text
    with pytest.raises(ValueError, match="broken"):
        asyncio.run(run_tasks("p1", [forever(), _raises_after(ValueError("broken"))]))


def test_an_error_wins_over_a_leave_that_ends_at_the_same_time():
    async def both() -> None:
        await run_tasks("p0", [_raises_after(ProducerLeft("left"), 0.05),
                               _raises_after(RuntimeError("engine died"), 0.05)])

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(both())
