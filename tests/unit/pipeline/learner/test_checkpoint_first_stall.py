"""The first checkpoint of a run stalls training no longer than the later ones: a one-time cost
of reading the trainer state is paid before the first step, not in the first checkpoint's stall.

The cost is real: accelerate's ``unwrap_model``, inside ``PolicyTrainer.state()``, imports
DeepSpeed the first time (when installed), seconds of imports. A real Learner (tiny model, CPU
trainer, real ZeroMQ socket) without the read before the first step stalled 2.24 s at its first
checkpoint and 0.03 s at its second on the 2-core machine; with it, 0.07 and 0.01 s. Here a test
double for that import (a first ``state()`` call that sleeps, named so) makes the check exact."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time

import numpy as np
from learner_fakes import make_learner

from buffer.protocol import Hello, Welcome
from buffer.schema import Completion, RolloutGroup
from buffer.transport import ProducerEndpoint
from pipeline.learner.trainer import PolicyTrainer

G = 4
FIRST_READ_S = 1.5  # the test double's one-time cost, above the 1-s goal for a stall
_seq = itertools.count()


def _group(i: int) -> RolloutGroup:
    rng = np.random.default_rng(i)
    return RolloutGroup(
        group_id=f"g{i}", producer_id="p0", prompt_id=f"g{i}",
        prompt_token_ids=rng.integers(32, 127, 5).astype(np.int32),
        completions=[Completion(token_ids=rng.integers(32, 127, 6).astype(np.int32),
                                logprobs=-rng.random(6).astype(np.float32) - 0.1,
                                version_segments=[(0, 0)], reward=float(k % 2))
                     for k in range(G)],
        metadata={"incarnation": "p0-test", "seq": next(_seq)})


async def _feed(learner, groups: list[RolloutGroup]) -> None:
    """Play producer p0: Hello, then the groups; returns when the learner's run ends."""
    ep = ProducerEndpoint(learner.cfg.bind_addr)
    task = asyncio.create_task(learner.run())
    try:
        hello = Hello(producer_id="p0", incarnation="p0-test", policy_version=0, pid=os.getpid())
        assert isinstance(await ep.call(hello, 120), Welcome)
        for g in groups:
            await ep.send(g, timeout=60)
        await asyncio.wait_for(task, 240)
    finally:
        task.cancel()
        ep.close()


def test_the_first_checkpoint_stall_holds_no_one_time_cost(tiny_model, tmp_path, monkeypatch):
    real = PolicyTrainer.state
    reads: list[float] = []

    def state(self):  # test double: the first read of the process is slow, as the import is
        if not reads:
            time.sleep(FIRST_READ_S)
        reads.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(PolicyTrainer, "state", state)
    learner = make_learner(tmp_path, tiny_model, **{
        "data.path": "arithmetic:10",
        "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
        "generation.group_size": G, "generation.max_tokens": 8, "engine.max_model_len": 64,
        "train.steps": 2, "train.batch_groups": 2, "train.mode": "async",
        "train.max_staleness": 8, "train.checkpoint_every": 1})
    assert len(reads) == 1  # read once before the first step, with the staging buffers
    asyncio.run(_feed(learner, [_group(i) for i in range(4)]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1)
    assert 0 < first["checkpoint_stall_s"] < 1.0, first["checkpoint_stall_s"]
