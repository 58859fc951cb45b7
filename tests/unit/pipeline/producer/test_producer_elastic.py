"""An elastic run's producer (pure control logic: no engine; the endpoint is a fake that answers
as the learner would): its admission share and data shard follow ``Announce.members``, and on
a leave request it starts nothing more, tells the learner, and ends once its groups are
durable."""

from __future__ import annotations

import asyncio

import pytest
from producer_fakes import CharTokenizer, RecordingEndpoint

from buffer.protocol import Announce, Leave
from pipeline.config import DataConfig, load_config
from pipeline.producer.data import PromptSource
from pipeline.producer.loop import Producer
from pipeline.producer.session import ProducerLeft


def _announce(members: list[str], **kw) -> Announce:
    return Announce(version=0, snapshot_uri="", snapshot_checksum="", learner_session="s",
                    received={}, consumed={}, members=members, **kw)


def _producer(tmp_path, index: int) -> Producer:
    cfg = load_config(overrides={"run_dir": str(tmp_path), "num_producers": 1,
                                 "max_producers": 3, "data.path": "arithmetic:12",
                                 "train.mode": "async", "train.batch_groups": 2,
                                 "train.max_staleness": 1})
    prompts = PromptSource(DataConfig(path="arithmetic:12"), 0, 1)
    return Producer(cfg, index, None, None, RecordingEndpoint(), None, prompts)


def test_a_joining_producer_starts_nothing_until_the_members_name_it_fake_endpoint(tmp_path):
    p = _producer(tmp_path, 2)
    assert p.share() is None and not p.may_start()

    async def run() -> None:
        await p._apply_announce(_announce(["p0"]))
        assert p.share() is None and not p.may_start()
        await p._apply_announce(_announce(["p0", "p2"]))
        assert p.share() == (2, 1) and p.may_start()
        await p._apply_announce(_announce(["p2"], leases={"p2": [0, 3, 5]}))
        assert p.share() == (1, 0)  # p0 left: the whole budget is ours
        assert [p.prompts.take().position for _ in range(2)] == [3, 4]  # our lease

    asyncio.run(run())


def test_the_admission_share_follows_the_members_fake_endpoint(tmp_path):
    """batch_groups 2, max_staleness 1: a budget of 4 groups, 2 each with two members."""
    p = _producer(tmp_path, 0)

    async def run() -> None:
        await p._apply_announce(_announce(["p0", "p1"]))
        p.rollout.generating = 2
        assert p.budget == 2 and not p.may_start()  # its share of two producers is spent
        await p._apply_announce(_announce(["p0"]))
        assert p.budget == 4 and p.may_start()  # alone, the whole budget is its

    asyncio.run(run())


def test_leaving_waits_for_the_groups_then_says_leave_and_ends_fake_endpoint(tmp_path):
    p = _producer(tmp_path, 0)

    async def run() -> None:
        await p._apply_announce(_announce(["p0"]))
        p.rollout.seq, p.accepted, p.rollout.generating = 3, 2, 1
        task = asyncio.create_task(p._leave())
        p.leave_requested.set()
        await asyncio.sleep(0.1)
        assert p.leaving and not p.may_start()
        assert not [m for m in p.endpoint.sent if isinstance(m, Leave)]  # a group still runs
        p.rollout.generating, p.accepted = 0, 3  # it ended and reached the learner
        p._budget_changed.set()
        with pytest.raises(ProducerLeft, match="after 3 group"):
            await asyncio.wait_for(task, 5)
        leave = [m for m in p.endpoint.sent if isinstance(m, Leave)]
        assert len(leave) == 1 and leave[0].sent == 3 and leave[0].producer_id == "p0"

    asyncio.run(run())


def test_admission_stops_once_the_groups_out_cover_the_last_step_fake_endpoint(tmp_path):
    """batch_groups 2, max_staleness 1: the budget is 4 groups, but once the learner has taken
    9 batches of 10 the run trains 2 more; in-flight groups count against them."""
    p = _producer(tmp_path, 0)

    async def run() -> None:
        await p._apply_announce(_announce(["p0"], last_step=10, steps_taken=8))
        p.rollout.generating = 3
        assert p.learner_to_go == 4 and p.may_start()
        p.rollout.generating = 2
        await p._apply_announce(_announce(["p0"], last_step=10, steps_taken=9))
        assert p.learner_to_go == 2 and not p.may_start()
        p.rollout.generating = 1
        assert p.may_start()
        await p._apply_announce(_announce(["p0"], last_step=10, steps_taken=10))
        p.rollout.generating = 0
        assert not p.may_start()  # the learner took its last batch

    asyncio.run(run())


def _shared_eval_config(tmp_path):
    """Two of at most three producers, shared evaluation of every version."""
    return load_config(overrides={"run_dir": str(tmp_path), "num_producers": 2,
                                  "max_producers": 3, "data.path": "arithmetic:12",
                                  "train.mode": "async", "train.batch_groups": 2,
                                  "train.max_staleness": 1, "train.steps": 10,
                                  "eval.every": 1, "eval.data": "arithmetic:4"})


def _evaluating_producer(tmp_path, index: int, monkeypatch) -> tuple[Producer, list[int]]:
    """Shared evaluation every version; generation is a fake that records the version."""
    import pipeline.producer.loop as loop_mod

    evaluated: list[int] = []

    async def generate_and_score(*args, **kw):
        evaluated.append(args[8])
        return {"eval/reward_mean": 0.5}

    monkeypatch.setattr(loop_mod, "generate_and_score", generate_and_score)
    cfg = _shared_eval_config(tmp_path)
    prompts = PromptSource(DataConfig(path="arithmetic:12"))
    return Producer(cfg, index, None, None, RecordingEndpoint(), None, prompts), evaluated


def test_the_evaluation_role_moves_on_when_the_first_member_leaves(tmp_path, monkeypatch):
    """p0 evaluates while it is the first member; once it has left, p1 takes the role with the
    version it runs (shared evaluation never stops for good)."""
    p1, evaluated = _evaluating_producer(tmp_path, 1, monkeypatch)

    async def run() -> None:
        await p1._apply_announce(_announce(["p0", "p1"]))
        assert evaluated == []  # p0's role
        await p1._apply_announce(_announce(["p1"]))  # p0 left
        assert evaluated == [0]

    asyncio.run(run())


def test_a_restarted_learner_gets_its_versions_evaluated_again_by_the_producer(
        tmp_path, monkeypatch):
    p0, evaluated = _evaluating_producer(tmp_path, 0, monkeypatch)

    async def run() -> None:
        await p0._apply_announce(_announce(["p0", "p1"]))
        await p0._apply_announce(_announce(["p0", "p1"]))
        assert evaluated == [0]  # once per version
        again = _announce(["p0", "p1"])
        again.learner_session = "s2"  # restarted from a checkpoint: v0 trained anew
        await p0._apply_announce(again)
        assert evaluated == [0, 0]

    asyncio.run(run())


def test_a_leave_while_admission_waits_for_the_engine_reads_no_prompt_fake_engine(tmp_path):
    """The engine sleeps (engine.sleep_when_idle) and the admission waits for its wake; a leave
    meanwhile: the Leave's cursor says no prompt was read, and no group starts after it (a
    prompt taken before the wait would count as read and never be generated)."""
    p = _producer(tmp_path, 0)
    p.tokenizer = CharTokenizer()
    woken = asyncio.Event()
    started: list = []

    class SleepingEngine:
        async def wake_up(self) -> None:
            await woken.wait()

    p.engine, p._asleep = SleepingEngine(), True
    p.rollout.start = lambda record, ids: started.append(record) or asyncio.create_task(
        asyncio.sleep(0))

    async def run() -> None:
        await p._apply_announce(_announce(["p0"], leases={"p0": [0, 0, 4]}))
        admit = asyncio.create_task(p._admit())
        await asyncio.sleep(0.05)  # the admission waits for the engine's wake
        leave = asyncio.create_task(p._leave())
        p.leave_requested.set()
        await asyncio.sleep(0.1)
        woken.set()
        with pytest.raises(ProducerLeft, match="after 0 group"):
            await asyncio.wait_for(leave, 5)
        await asyncio.sleep(0.05)
        admit.cancel()
        sent = [m for m in p.endpoint.sent if isinstance(m, Leave)]
        assert len(sent) == 1 and sent[0].cursor == 0, sent  # no prompt read: all handed back
        assert started == [] and p.prompts.cursor == 0

    asyncio.run(run())


def test_the_evaluating_producer_evaluates_while_it_leaves_fake_engine(tmp_path, monkeypatch):
    """p0 evaluates and is leaving (a group of its still generates, so its Leave is not sent
    yet): the versions due meanwhile are evaluated, by p0, since p1 is not the first member
    until the learner has taken p0 out; then p1 evaluates."""
    import pipeline.producer.loop as loop_mod

    evaluated: list[tuple[str, int]] = []
    producers: dict[str, Producer] = {}

    async def generate_and_score(*args, **kw):  # args[6]: the evaluating producer's prompts
        who = next(pid for pid, p in producers.items() if p.eval_records is args[6])
        evaluated.append((who, args[8]))
        return {"eval/reward_mean": 0.5}

    monkeypatch.setattr(loop_mod, "generate_and_score", generate_and_score)
    cfg = _shared_eval_config(tmp_path)
    for i in (0, 1):
        producers[f"p{i}"] = Producer(cfg, i, None, None, RecordingEndpoint(), None,
                                      PromptSource(DataConfig(path="arithmetic:12")))

    async def announce(version: int, members: list[str]) -> None:
        for p in producers.values():
            ann = _announce(members)
            ann.version = version
            await p._apply_announce(ann)

    async def run() -> None:
        await announce(0, ["p0", "p1"])
        p0 = producers["p0"]
        p0.rollout.generating = 1  # its last group: its Leave waits for it
        leave = asyncio.create_task(p0._leave())
        p0.leave_requested.set()
        await asyncio.sleep(0.05)
        assert p0.leaving
        await announce(1, ["p0", "p1"])  # published while p0 leaves
        p0.rollout.generating = 0
        p0._budget_changed.set()
        with pytest.raises(ProducerLeft):
            await asyncio.wait_for(leave, 5)
        await announce(2, ["p1"])  # the learner took p0 out
        assert evaluated == [("p0", 0), ("p0", 1), ("p1", 2)], evaluated

    asyncio.run(run())
