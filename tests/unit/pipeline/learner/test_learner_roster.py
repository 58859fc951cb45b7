"""The learner's members across a leave and a kill -9 (a real Learner on the tiny model; control
messages go straight to its handler): sync mode, p1 leaves, the learner restarts; it has one
member, so p0's share is the whole batch and steps can go on (a ghost p1 would halve it and the
batch would never fill)."""

from __future__ import annotations

import asyncio
import time

from learner_fakes import hello, make_learner

from buffer.protocol import Heartbeat, Hello, Leave, Reply
from pipeline.learner.producers import ALIVE_S


def test_a_producer_that_left_is_no_member_of_the_restarted_learner(tiny_model, tmp_path):
    conf = {"num_producers": 2, "max_producers": 3, "train.mode": "sync",
            "train.batch_groups": 4}
    learner = make_learner(tmp_path, tiny_model, **conf)
    learner.metrics.close()
    for pid in ("p0", "p1"):
        learner.control.answer(hello(pid, f"{pid}-1"))
    learner.control.announcement()
    leave = Leave(producer_id="p1", incarnation="p1-1", sent=0, cursor=3)
    assert learner.control.answer(leave) == Reply(ok=True)

    # kill -9: a new learner on the same run_dir (the launcher restarts it)
    again = make_learner(tmp_path, tiny_model, **conf)
    again.metrics.close()
    assert again.control.announcement().members == ["p0"]
    again.control.answer(hello("p0", "p0-1"))
    again.control.answer(Heartbeat(producer_id="p0", incarnation="p0-1", policy_version=0, stats={},
                            cursor=8))  # p0 read its first lease (positions 0..7)
    # p1 had read 3 of its lease (8..15): the rest comes first, then new positions
    assert again.control.announcement().leases["p0"] == [0, 0, 8, 11, 16, 16, 19]
    # p1, still waiting for the checkpoint of its groups, says Hello to the new learner
    again.control.answer(Hello(producer_id="p1", incarnation="p1-1", policy_version=0, pid=1,
                        leaving=True))
    assert again.control.announcement().members == ["p0"] and again.control.checkpoint_soon

    # p2 joins, is asked to leave, and dies before its Leave: out once silent
    again.control.answer(hello("p2", "p2-1"))
    again.control.answer(Heartbeat(producer_id="p2", incarnation="p2-1", policy_version=0, stats={},
                            leaving=True))
    again.control._drop_dead_leavers()
    assert again.control.announcement().members == ["p0", "p2"]  # heard from just now
    silent_since = time.monotonic() - ALIVE_S - 1
    again.control.producers["p2"].last_seen = again.control._started = silent_since
    again.control._drop_dead_leavers()
    assert again.control.announcement().members == ["p0"]


class _Clock:
    """``time`` for ``pipeline.learner.control`` only: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


def test_a_slow_restart_gives_a_leaving_member_its_grace_from_the_first_answer(
        tiny_model, tmp_path, monkeypatch):
    """A restarted learner whose start took longer than ``ALIVE_S`` (the snapshot of a big
    resumed version) keeps a member the roster names as leaving for ``ALIVE_S`` from when it
    begins to answer: that producer, alive and waiting for the checkpoint of its groups, has
    had no chance to say Hello yet. Silent for ``ALIVE_S`` after that, it is taken out."""
    from learner_fakes import Running

    import pipeline.learner.control as control_mod

    conf = {"num_producers": 2, "max_producers": 3, "train.mode": "async",
            "train.batch_groups": 4}
    learner = make_learner(tmp_path, tiny_model, **conf)
    learner.metrics.close()
    for pid in ("p0", "p1"):
        learner.control.answer(hello(pid, f"{pid}-1"))
    learner.control.answer(Heartbeat(producer_id="p1", incarnation="p1-1", policy_version=0,
                                     stats={}, leaving=True))

    clock = _Clock()
    monkeypatch.setattr(control_mod, "time", clock)
    again = make_learner(tmp_path, tiny_model, **conf)  # kill -9, restarted by the launcher
    again.metrics.close()
    clock.now += ALIVE_S + 5  # its start: the resumed version's snapshot written

    async def run() -> None:
        async with Running(again):
            await asyncio.sleep(0.05)  # it answers from now
            again.control._drop_dead_leavers()
            assert again.control.announcement().members == ["p0", "p1"]
            clock.now += ALIVE_S
            again.control._drop_dead_leavers()
            assert again.control.announcement().members == ["p0"]

    asyncio.run(run())
