"""A real Learner (tiny model, CPU trainer, real ZeroMQ socket) fed by a real ProducerEndpoint:
groups that decode but are wrong for the run are rejected and counted, never trained; a batch on
which the training step raises is dropped and the run goes on; a resumed checkpoint holding a bad
group is re-checked. Each bad group here used to end the learner process. And a stop that lands
while a step trains waits for that step, which the final checkpoint then holds."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from buffer.checks import RunLimits
from buffer.protocol import Hello, Welcome
from buffer.schema import Completion, RolloutGroup
from buffer.store import RolloutBuffer
from buffer.transport import ProducerEndpoint
from pipeline.config import load_config
from pipeline.launch.derive import resolve
from pipeline.learner.checkpoint import latest_checkpoint
from pipeline.learner.loop import Learner

G = 4


def _cfg(tiny_model: Path, run_dir: Path, steps: int):
    return resolve(load_config(overrides={
        "model.path": str(tiny_model), "data.path": "arithmetic:10",
        "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward", "weight": 1.0}],
        "run_dir": str(run_dir), "generation.group_size": G, "generation.max_tokens": 8,
        "engine.max_model_len": 64, "train.steps": steps, "train.batch_groups": 2,
        "train.mode": "async", "train.max_staleness": 8, "train.batch_timeout_s": 120.0,
        "tensorboard": False, "progress": False}))


def group(gid: str, n: int = G, plen: int = 5, seed: int = 0) -> RolloutGroup:
    rng = np.random.default_rng(seed)
    return RolloutGroup(
        group_id=gid, producer_id="p0", prompt_id=gid,
        prompt_token_ids=rng.integers(32, 127, plen).astype(np.int32),
        completions=[Completion(token_ids=rng.integers(32, 127, 6).astype(np.int32),
                                logprobs=-rng.random(6).astype(np.float32) - 0.1,
                                version_segments=[(0, 0)], reward=float(i % 2))
                     for i in range(n)])


def bad(reason: str) -> RolloutGroup:
    g = group(f"bad-{reason}")
    if reason == "group_size":
        g.completions = g.completions[:1]
    elif reason == "empty_prompt":
        g.prompt_token_ids = np.zeros(0, dtype=np.int32)
    elif reason == "token_out_of_vocab":
        g.completions[2].token_ids[3] = 10**6
    return g


INCARNATION = "p0-test"
_seq = itertools.count()  # unique across the learners of a test (the ledger drops repeats)


async def _play_p0(ep: ProducerEndpoint, groups: list[RolloutGroup]) -> None:
    """Play producer p0: Hello, then the groups with their incarnation and seq."""
    hello = Hello(producer_id="p0", incarnation=INCARNATION, policy_version=0, pid=os.getpid())
    assert isinstance(await ep.call(hello, 120), Welcome)
    for g in groups:
        g.metadata = {**g.metadata, "incarnation": INCARNATION, "seq": next(_seq)}
        await ep.send(g, timeout=60)


async def _run(learner: Learner, groups: list[RolloutGroup], timeout: float = 240.0) -> None:
    """The learner's run with p0's groups, to its end."""
    ep = ProducerEndpoint(learner.cfg.bind_addr)
    task = asyncio.create_task(learner.run())
    try:
        await _play_p0(ep, groups)
        await asyncio.wait_for(task, timeout)
    finally:
        task.cancel()
        ep.close()


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ln.strip()]


@pytest.mark.parametrize("reason", ["group_size", "empty_prompt", "token_out_of_vocab"])
def test_a_group_wrong_for_the_run_is_rejected_and_the_run_completes(tiny_model, tmp_path,
                                                                     reason):
    learner = Learner(_cfg(tiny_model, tmp_path, steps=2), str(tiny_model))
    goods = [group(f"ok{i}", seed=i) for i in range(4)]
    asyncio.run(_run(learner, [goods[0], bad(reason), *goods[1:]]))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1][f"rejected_groups/{reason}"] == 1 and rows[-1]["rejected_groups"] == 1
    st = learner.buffer.stats
    assert st.served == 4 and st.received == 5 and st.rejected_groups == {reason: 1}
    assert learner.state.received == {"p0": 4}  # a rejected group is no producer's progress


def test_a_batch_that_raises_in_the_trainer_is_dropped_and_the_run_goes_on_checks_bypassed(
        tiny_model, tmp_path, caplog):
    """The checks are widened (a vocabulary of 10**9) so that an out-of-vocab id reaches the
    real trainer and its embedding lookup raises, as any unforeseen bad data would."""
    learner = Learner(_cfg(tiny_model, tmp_path, steps=2), str(tiny_model))
    real = learner.limits
    learner.limits = lambda: RunLimits(**{**real().__dict__, "vocab_size": 10**9})
    # What the announce tells producers of the run's end (Announce.last_step, steps_taken)
    # when the learner waits for a batch and while it trains one: a dropped batch's step
    # still needs its groups.
    seen = []
    get_batch, train_batch = learner.buffer.get_batch, learner._train_batch

    def told(when: str) -> None:
        a = learner.control.announcement()
        seen.append((when, learner.state.step, a.steps_taken, a.last_step))

    async def waiting(*args, **kw):
        told("wait")
        return await get_batch(*args, **kw)

    async def training(*args, **kw):
        told("train")
        return await train_batch(*args, **kw)

    learner.buffer.get_batch, learner._train_batch = waiting, training
    goods = [group(f"ok{i}", seed=i) for i in range(5)]
    asyncio.run(_run(learner, [bad("token_out_of_vocab"), *goods]))
    assert seen == [("wait", 0, 0, 2), ("train", 0, 1, 2), ("wait", 0, 0, 2),
                    ("train", 0, 1, 2), ("wait", 1, 1, 2), ("train", 1, 2, 2)]
    assert learner.control.announcement().steps_taken == 2
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["dropped_batches"] == 1 and rows[-1]["dropped_batch_groups"] == 2
    assert learner.buffer.stats.served == 6  # served to the trainer; two of them dropped there
    msg = [r.getMessage() for r in caplog.records if "dropped the batch" in r.getMessage()]
    assert len(msg) == 1 and "bad-token_out_of_vocab" in msg[0] and "ok0" in msg[0]


def test_a_resumed_checkpoint_holding_a_bad_group_is_rechecked(tiny_model, tmp_path):
    learner = Learner(_cfg(tiny_model, tmp_path, steps=1), str(tiny_model))
    asyncio.run(_run(learner, [group(f"ok{i}", seed=i) for i in range(2)]))
    # Put a bad group (and a good one) into the checkpoint's buffer, as an earlier build that
    # did not check groups would have stored them.
    ckpt = latest_checkpoint(tmp_path)
    cfg = learner.cfg
    buf = RolloutBuffer.restore((ckpt / "buffer.msgpack").read_bytes(), cfg.buffer_capacity,
                                cfg.train.max_staleness)
    buf.put(bad("group_size"))
    buf.put(group("kept", seed=9))
    (ckpt / "buffer.msgpack").write_bytes(buf.snapshot())

    resumed = Learner(_cfg(tiny_model, tmp_path, steps=3), str(tiny_model), resume=True)
    assert len(resumed.buffer) == 1
    assert resumed.buffer.stats.rejected_groups == {"group_size": 1}
    asyncio.run(_run(resumed, [group(f"new{i}", seed=20 + i) for i in range(3)]))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rejected_groups/group_size"] == 1
    st = resumed.buffer.stats
    assert st.received == st.served + st.dropped_stale + st.dropped_capacity + st.size + 1


def test_a_stop_that_lands_mid_step_waits_for_the_step_and_checkpoints_it(tiny_model, tmp_path):
    """Ctrl-C (the learner's task cancelled) while the second step's optimiser update runs:
    the step ends and is counted, its row is written (interrupted) and the final checkpoint
    holds it, so the batch that left the buffer is neither lost nor trained again on resume."""
    import threading

    from pipeline.learner.checkpoint import load_checkpoint

    learner = Learner(_cfg(tiny_model, tmp_path, steps=5), str(tiny_model))
    real_step, calls = learner.trainer.step, []
    in_step, release = threading.Event(), threading.Event()

    def step(batch, version):
        calls.append(len(batch))
        if len(calls) == 2:
            in_step.set()
            release.wait(60)
        return real_step(batch, version)

    learner.trainer.step = step

    async def main() -> None:
        ep = ProducerEndpoint(learner.cfg.bind_addr)
        task = asyncio.create_task(learner.run())
        try:
            await _play_p0(ep, [group(f"s{i}", seed=30 + i) for i in range(6)])
            await asyncio.wait_for(asyncio.to_thread(in_step.wait, 120), 130)
            task.cancel()  # what Ctrl-C does to the learner's loop
            await asyncio.sleep(0.3)  # the cancel has landed while the step is under way
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 120)
        finally:
            release.set()
            ep.close()

    asyncio.run(main())
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["interrupted"] == 1.0
    # Every figure of a full row, but those of the snapshot it did not publish.
    assert {k for k in rows[0] if not k.startswith(("snapshot_", "staleness_hist/",
                                                    "checkpoint_write_"))} <= set(rows[-1])
    assert rows[-1]["received"] == 6.0 and rows[-1]["version"] == 1.0  # no snapshot after it
    state, _tensors, buf_bytes = load_checkpoint(latest_checkpoint(tmp_path))
    st = RolloutBuffer.restore(buf_bytes, 10**6, None).stats
    assert state.step == 2 and st.served == 2 * 2  # every group that left the buffer trained
    assert st.received == st.served + st.size
    # Step 2's update makes version 2 (it would have been published had no stop come): the
    # checkpoint holds it under that number, and the resumed learner publishes it as version
    # 2 first, so a producer still on version 1 loads it instead of keeping the older weights.
    assert state.version == 2

    import torch

    from sync.snapshot import read_snapshot

    cfg = _cfg(tiny_model, tmp_path, steps=5)
    cfg.train.batch_groups = 3  # more than the 2 groups it holds: it waits, trains nothing
    resumed = Learner(cfg, str(tiny_model), resume=True)

    async def start() -> None:
        task = asyncio.create_task(resumed.run())
        try:
            while resumed.control.snapshot is None:
                assert not task.done()
                await asyncio.sleep(0.05)
            ref = resumed.control.snapshot
            assert ref.version == 2
            weights = read_snapshot(ref)
            own = resumed.trainer.snapshot_tensors()  # the checkpoint's weights, after step 2
            assert set(weights) == set(own)
            assert all(torch.equal(weights[k], own[k]) for k in own)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(start())
