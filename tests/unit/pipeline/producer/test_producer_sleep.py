"""engine.sleep_when_idle: the producer sleeps its engine only when nothing is generating and
wakes it before a swap or an admission (the engine is a fake that records calls)."""

from __future__ import annotations

import asyncio

from pipeline.config import load_config
from pipeline.launch.derive import resolve
from pipeline.producer.loop import Producer


class SleepyEngineFake:
    def __init__(self):
        self.calls: list[str] = []

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep{level}")

    async def wake_up(self, tags=None) -> None:
        self.calls.append("wake")


def _producer(tmp_path, on: bool):
    cfg = resolve(load_config(overrides={"run_dir": str(tmp_path), "train.mode": "sync",
                                         "engine.sleep_when_idle": on}))
    engine = SleepyEngineFake()
    return Producer(cfg, 0, engine, None, None, None, None), engine


def test_sleeps_when_idle_and_wakes_once_fake_engine(tmp_path):
    p, engine = _producer(tmp_path, True)

    async def run():
        p.rollout.generating = 1
        await p._sleep_if_idle()          # a group is generating: stay awake
        p.rollout.generating = 0
        await p._sleep_if_idle()
        await p._sleep_if_idle()          # already asleep
        await p._wake()
        await p._wake()                   # already awake

    asyncio.run(run())
    assert engine.calls == ["sleep1", "wake"]
    assert p.stats.sleeps == 1 and p.stats.sleep_s >= 0 and p.stats.wake_s >= 0


def test_off_by_default_fake_engine(tmp_path):
    p, engine = _producer(tmp_path, False)
    asyncio.run(p._sleep_if_idle())
    assert engine.calls == []
