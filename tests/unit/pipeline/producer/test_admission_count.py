"""The producer's count of its outstanding groups (``Producer.outstanding``, which admission
compares with the budget): a group counts once from its admission until the learner has consumed
it, never twice and never not at all, whichever task the event loop runs in between. Real
``GroupRollout`` and ``RewardSet``; the engine request and the endpoint are fakes, named so."""

from __future__ import annotations

import asyncio

from producer_fakes import RecordingEndpoint, completion_fake, producer_fake_engine

from pipeline.producer.data import PromptRecord


class SlowSendEndpointFake(RecordingEndpoint):
    """A data channel whose send yields to the loop a few times, as a ZeroMQ send can."""

    async def send(self, group, timeout: float | None = None) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        await super().send(group, timeout)


async def _generate_fake(rid, prompt_ids, sp):
    n = int(rid.rsplit("-", 1)[1]) + 1  # different lengths: different rewards, none dropped
    await asyncio.sleep(0)
    return completion_fake(n)


def test_a_group_counts_once_from_admission_to_the_learner_fake_engine(tmp_path):
    endpoint = SlowSendEndpointFake()
    p = producer_fake_engine(tmp_path, endpoint)
    p.rollout._generate_one = _generate_fake
    seen: list[int] = []

    async def run() -> None:
        async def monitor():
            while True:
                seen.append(p.outstanding())
                await asyncio.sleep(0)

        mon = asyncio.create_task(monitor())
        tasks = [p.rollout.start(PromptRecord(f"q{i}", "Q?", {}, i + 1), [81, 63])
                 for i in range(2)]
        assert p.outstanding() == 2  # counted from admission, before the tasks first run
        await asyncio.gather(*tasks)
        await asyncio.sleep(0)
        assert p.in_flight_groups == 0 and p.rollout.seq == 2
        assert p.outstanding() == 2  # in transit: sent, the learner has not announced them
        p.accepted, p.held = 2, 2     # the learner has them in its buffer
        assert p.outstanding() == 2
        p.held = 0                    # and trained on them
        assert p.outstanding() == 0
        mon.cancel()

    asyncio.run(run())
    assert len(endpoint.sent) == 2
    assert set(seen) == {2}, f"outstanding read {sorted(set(seen))} while two groups ran"


def test_a_dropped_or_failed_group_leaves_the_count_fake_engine(tmp_path):
    p = producer_fake_engine(tmp_path, **{"generation.group_size": 2})

    async def fails(rid, prompt_ids, sp):
        raise RuntimeError("engine died")

    p.rollout._generate_one = fails

    async def run() -> None:
        task = p.rollout.start(PromptRecord("q0", "Q?", {}, 1), [81, 63])
        assert p.outstanding() == 1
        await asyncio.gather(task, return_exceptions=True)
        assert p.outstanding() == 0 and p.rollout.seq == 0

    asyncio.run(run())
