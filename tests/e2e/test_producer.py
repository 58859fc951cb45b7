"""Producer end to end: a real vLLM CPU AsyncLLM on the tiny model, real ZMQ, real rewards.

The test plays the learner: it binds a LearnerEndpoint (ipc:// in a temp dir), publishes
Announce(version=0, snapshot_uri="") periodically with the consumed counts it chooses, and
receives the groups. One engine (and one event loop, which the AsyncLLM is bound to) serves the
whole module; the last test cancels a producer mid-generation and shuts the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_no_children

from buffer.protocol import Announce, Hello, Reply, Welcome
from buffer.schema import RolloutGroup
from buffer.transport import LearnerEndpoint, ProducerEndpoint
from pipeline.config import RunConfig, load_config
from pipeline.producer.data import PromptSource, render_prompt
from pipeline.producer.loop import Producer
from pipeline.producer.rewards.runner import RewardSet
from tests.sampling_reference import sampled_logprob
from tests.waiting import settle

pytestmark = pytest.mark.slow

GROUP_SIZE = 4
MAX_TOKENS = 12
SESSION = "test-learner"


@pytest.fixture(scope="module")
def engine_env(tiny_model):
    """(loop, engine, tokenizer): one AsyncLLM for the module, built inside its own loop."""
    from transformers import AutoTokenizer

    from pipeline.producer.engine import build_engine

    cfg = _config(tiny_model, "ipc:///tmp/unused")
    loop = asyncio.new_event_loop()

    async def build():
        return build_engine(cfg.model, cfg.engine, str(tiny_model), cfg.engine.seed)

    engine = loop.run_until_complete(build())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    try:
        yield loop, engine, tokenizer
    finally:
        engine.shutdown()  # idempotent: the last test already shut it down
        # Let the engine's output-handler task see its cancellation before the loop closes.
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def _config(model: Path, addr: str, **over) -> RunConfig:
    base = {
        "addr": addr, "run_dir": tempfile.mkdtemp(prefix="producer-e2e-"),
        "model.path": str(model), "model.dtype": "float32",
        "engine.max_model_len": 512, "engine.gpu_memory_utilization": 0.1,
        "engine.max_num_seqs": 16,
        "generation.group_size": GROUP_SIZE, "generation.max_tokens": MAX_TOKENS,
        "data.path": "arithmetic:64",
        "rewards.specs": [{"fn": "pipeline.tasks.rewards:exact_match"},
                          {"fn": "pipeline.tasks.rewards:length_reward", "weight": 0.01}],
        "train.batch_groups": 2, "train.max_staleness": 0,
    }
    base.update(over)
    return load_config(None, base)


class FakeLearner:
    """The learner side of the wire: receives groups, answers control requests, announces
    version 0 and consumption."""

    def __init__(self, addr: str):
        self.endpoint = LearnerEndpoint(addr)
        self.groups: list[RolloutGroup] = []
        self.hellos: list[Hello] = []
        self.consumed = 0
        self.announcing = False

    def announce_msg(self) -> Announce:
        accepted: dict[str, int] = {}
        for g in self.groups:
            inc = str(g.metadata["incarnation"])
            accepted[inc] = accepted.get(inc, 0) + 1
        return Announce(version=0, snapshot_uri="", snapshot_checksum="",
                        learner_session=SESSION, received={"p0": len(self.groups)},
                        consumed={"p0": self.consumed}, accepted=accepted)

    async def run(self) -> None:
        async def receive():
            while True:
                group = await self.endpoint.recv()
                if group is not None:
                    self.groups.append(group)

        async def control():
            while True:
                got = await self.endpoint.recv_control()
                if got is None:
                    continue
                peer, rid, msg = got
                if isinstance(msg, Hello):
                    self.hellos.append(msg)
                    answer = Welcome(producer_id=msg.producer_id, incarnation=msg.incarnation,
                                     learner_session=SESSION)
                else:
                    answer = Reply(ok=True)
                await self.endpoint.reply(peer, rid, answer)

        async def announce():
            while True:
                if self.announcing:
                    await self.endpoint.publish(self.announce_msg())
                await asyncio.sleep(0.1)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(receive())
            tg.create_task(control())
            tg.create_task(announce())


def _make_producer(cfg: RunConfig, engine, tokenizer) -> Producer:
    prompts = PromptSource(cfg.data, 0, cfg.num_producers)
    rewards = RewardSet(cfg.rewards.specs, on_failure=cfg.rewards.on_failure,
                        pool_workers=cfg.rewards.pool_workers)
    return Producer(cfg, 0, engine, tokenizer, ProducerEndpoint(cfg.bind_addr), rewards, prompts)


@contextlib.asynccontextmanager
async def _running(cfg: RunConfig, engine, tokenizer):
    learner = FakeLearner(cfg.bind_addr)
    producer = _make_producer(cfg, engine, tokenizer)
    ltask = asyncio.create_task(learner.run())
    ptask = asyncio.create_task(producer.run())
    try:
        yield learner, producer, ptask
    finally:
        for t in (ptask, ltask):
            t.cancel()
        for t in (ptask, ltask):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        producer.endpoint.close()
        producer.rewards.close()
        learner.endpoint.close()


def _short_dir() -> str:
    # ipc:// paths must fit in a sockaddr_un (~107 bytes): pytest's tmp_path can be too long.
    return tempfile.mkdtemp(prefix="pe2e-", dir="/tmp")


def test_groups_shapes_rewards_and_admission_cap(engine_env, tiny_model):
    loop, engine, tokenizer = engine_env
    cfg = _config(tiny_model, f"ipc://{_short_dir()}/l.sock")
    budget = (cfg.train.max_staleness + 1) * cfg.train.batch_groups
    target = 6
    violations: list[str] = []

    async def scenario():
        async with _running(cfg, engine, tokenizer) as (learner, producer, ptask):
            assert producer.budget == budget

            async def monitor():
                # Invariant: never more than `budget` groups generated-or-unconsumed. The
                # producer only learns consumption from our announces, so every group it ever
                # started is within `budget` of what we have announced as consumed.
                while True:
                    if producer.stats.groups_started > learner.consumed + budget:
                        violations.append(f"started {producer.stats.groups_started} with "
                                          f"consumed {learner.consumed}")
                    if len(learner.groups) > learner.consumed + budget:
                        violations.append(f"received {len(learner.groups)} with consumed "
                                          f"{learner.consumed}")
                    if producer.outstanding() > budget:
                        violations.append(f"outstanding {producer.outstanding()}")
                    await asyncio.sleep(0.005)

            mon = asyncio.create_task(monitor())
            # 1. No admission before the first announce.
            await settle(lambda: learner.hellos, "the producer's Hello", timeout=30)
            await asyncio.sleep(2.0)
            assert producer.stats.groups_started == 0 and not learner.groups
            assert not producer.weights.tracker.in_flight

            # 2. Announce version 0 but consume nothing: exactly `budget` groups, then it waits.
            learner.announcing = True
            await settle(lambda: len(learner.groups) >= budget, f"{budget} groups", timeout=120)
            await asyncio.sleep(2.0)
            assert len(learner.groups) == budget
            assert producer.stats.groups_started == budget
            assert not producer.weights.tracker.in_flight

            # 3. A slow consumer: one group per 0.5 s; the producer follows, within the budget.
            while len(learner.groups) < target:
                await asyncio.sleep(0.5)
                learner.consumed = min(learner.consumed + 1, len(learner.groups))
                assert not ptask.done(), ptask
            mon.cancel()
            return learner.groups

    groups = loop.run_until_complete(asyncio.wait_for(scenario(), 300))
    assert not violations, violations[:5]

    for g in groups:
        assert g.producer_id == "p0"
        assert len(g.completions) == GROUP_SIZE
        assert g.policy_version == 0
        assert g.prompt_token_ids.dtype == np.int32 and len(g.prompt_token_ids) > 0
        for c in g.completions:
            n = len(c.token_ids)
            assert 1 <= n <= MAX_TOKENS
            assert c.logprobs.shape == c.token_ids.shape
            assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 1e-3)
            assert [tuple(s) for s in c.version_segments] == [(0, 0)]
            assert c.finish_reason in ("length", "stop")
            assert set(c.reward_breakdown) == {"exact_match", "length_reward"}
            assert c.reward == pytest.approx(c.reward_breakdown["exact_match"]
                                             + 0.01 * c.reward_breakdown["length_reward"])
            # length_reward = -|20 - len(text)|, text of at most MAX_TOKENS byte tokens.
            assert -20.0 <= c.reward_breakdown["length_reward"] <= -(20.0 - MAX_TOKENS)
    # The prompt tokens are the chat-templated prompt of the record the group names.
    by_id = {r["prompt_id"]: r for r in _records(cfg)}
    g = groups[0]
    assert g.prompt_token_ids.tolist() == render_prompt(tokenizer, cfg.data,
                                                        by_id[g.prompt_id]["prompt"])
    assert len({g.group_id for g in groups}) == len(groups)


# generation overrides -> the (temperature, top_p, top_k) the completions must record
SAMPLINGS = {
    "temperature 0.5": ({"generation.temperature": 0.5}, (0.5, 1.0, 0)),
    "temperature 1.0": ({}, None),
    "temperature 1.5": ({"generation.temperature": 1.5}, (1.5, 1.0, 0)),
    "temperature 0.7, top-p 0.9": ({"generation.temperature": 0.7, "generation.top_p": 0.9},
                                   (0.7, 0.9, 0)),
    "top-k 20": ({"generation.top_k": 20}, (1.0, 1.0, 20)),
}
EPISODES = "tests.e2e.support.episodes:tempered_turns"


def _collect(engine_env, cfg: RunConfig, count: int) -> list[RolloutGroup]:
    loop, engine, tokenizer = engine_env

    async def scenario():
        async with _running(cfg, engine, tokenizer) as (learner, _producer, ptask):
            learner.announcing = True
            learner.consumed = count  # room for all of them at once
            await settle(lambda: len(learner.groups) >= count or ptask.done(),
                         f"{count} groups", timeout=120)
            assert not ptask.done(), ptask
            return learner.groups[:count]

    return loop.run_until_complete(asyncio.wait_for(scenario(), 200))


def _reference(model, group: RolloutGroup) -> list[tuple[np.ndarray, np.ndarray]]:
    """Independent of the learner's code: per completion, log p(token) under each token's
    recorded distribution (``tests.sampling_reference``), and the raw log_softmax(logits)
    beside it."""
    import torch

    out = []
    for c in group.completions:
        ids = np.concatenate([group.prompt_token_ids, c.token_ids]).astype(np.int64)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids)[None]).logits[0].double().numpy()
        p0 = len(group.prompt_token_ids)
        temps, top_ps, top_ks = c.per_token_sampling()
        ref, raw = [], []
        for j, tok in enumerate(c.token_ids):
            z = logits[p0 - 1 + j]
            raw.append(z[tok] - z.max() - np.log(np.exp(z - z.max()).sum()))
            ref.append(sampled_logprob(z, int(tok), float(temps[j]), float(top_ps[j]),
                                       int(top_ks[j]), keep_sampled=False))
        out.append((np.asarray(ref), np.asarray(raw)))
    return out


def _learner_gap(trainer, groups: list[RolloutGroup]) -> tuple[float, float]:
    """Mean and max |behaviour - learner logprob| over the loss tokens of ``groups``, the
    learner's logprobs computed as its step computes them (pack, collate, policy forward)."""
    import torch

    from pipeline.learner.batching import pack_groups
    from pipeline.learner.logprobs import device_batch, micro_batch_logprobs

    pb = pack_groups(groups, True, 1e-6)
    rows = list(range(len(pb.sequences)))
    b, attention = device_batch(pb, rows, False, trainer.pad_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = micro_batch_logprobs(trainer.policy, None, b, attention)
    gap = (lp - b["behaviour"]).abs()[b["mask"]]
    return float(gap.mean()), float(gap.max())


def test_logprobs_are_of_the_distribution_the_engine_sampled(engine_env, tiny_model):
    """At lag 0 (fp32, CPU), for each temperature and truncation: every behaviour logprob the
    engine returns equals an independent recomputation of the sampled distribution, and so does
    the learner's, within 1e-4 a token; the raw log-softmax is far from both (the test fails
    on it). Then an episode whose turns each draw from another distribution."""
    from pipeline.learner.trainer import PolicyTrainer

    trainer = PolicyTrainer(_config(tiny_model, "ipc:///tmp/unused"), str(tiny_model),
                            device="cpu")
    model = trainer.model.eval()
    for name, (over, recorded) in SAMPLINGS.items():
        cfg = _config(tiny_model, f"ipc://{_short_dir()}/l.sock", **over)
        groups = _collect(engine_env, cfg, 2)
        ref_gap, raw_gap = [], []
        for g in groups:
            for c, (ref, raw) in zip(g.completions, _reference(model, g), strict=True):
                assert [tuple(s) for s in c.sampling_segments] == \
                    ([] if recorded is None else [(0, *recorded)]), name
                ref_gap.append(np.abs(c.logprobs - ref))
                raw_gap.append(np.abs(c.logprobs - raw))
        ref_gap, raw_gap = np.concatenate(ref_gap), np.concatenate(raw_gap)
        mean, worst = _learner_gap(trainer, groups)
        assert ref_gap.mean() <= 1e-4, f"{name}: engine vs reference {ref_gap.mean():.2e}"
        assert mean <= 1e-4, f"{name}: learner vs engine {mean:.2e} (max {worst:.2e})"
        if recorded is not None:
            assert raw_gap.mean() > 1e-2, f"{name}: raw logprobs would pass ({raw_gap.mean()})"

    # An episode: turns at temperature 0.5, then 1.5 with top-k 20, then the run's 0.7.
    cfg = _config(tiny_model, f"ipc://{_short_dir()}/l.sock", **{
        "episode.fn": EPISODES, "episode.max_tokens": 30, "generation.temperature": 0.7})
    groups = _collect(engine_env, cfg, 2)
    kinds = set()
    for g in groups:
        for c, (ref, _raw) in zip(g.completions, _reference(model, g), strict=True):
            keep = c.loss_mask()
            assert np.abs(c.logprobs - ref)[keep].mean() <= 1e-4
            kinds |= {tuple(s[1:]) for s in c.sampling_segments}
    assert kinds == {(0.5, 1.0, 0), (1.5, 1.0, 20), (0.7, 1.0, 0)}, kinds
    mean, worst = _learner_gap(trainer, groups)
    assert mean <= 1e-4, f"episode: learner vs engine {mean:.2e} (max {worst:.2e})"

    # A turn's override the learner could not recompute never reaches the engine.
    from types import SimpleNamespace

    from pipeline.producer.group import GroupRollout
    from pipeline.producer.trained_sampling import UntrainableSampling

    rollout = SimpleNamespace(cfg=cfg, final=True)
    assert GroupRollout._sampling(rollout, temperature=1.5, top_k=20).top_k == 20
    with pytest.raises(UntrainableSampling, match=r"min_p=0\.1"):
        GroupRollout._sampling(rollout, min_p=0.1)


def _records(cfg: RunConfig):
    from pipeline.producer.data import load_records

    return load_records(cfg.data.path)


def test_cancel_aborts_in_flight_requests_and_leaves_no_children(engine_env, tiny_model):
    loop, engine, tokenizer = engine_env
    # Long completions so that requests are certainly running when the producer is cancelled.
    cfg = _config(tiny_model, f"ipc://{_short_dir()}/l.sock", **{
        "generation.max_tokens": 400, "generation.ignore_eos": True,
        "train.batch_groups": 2, "train.max_staleness": 1})

    async def scenario():
        async with _running(cfg, engine, tokenizer) as (learner, producer, ptask):
            learner.announcing = True
            await settle(lambda: producer.stats.tokens == 0 and
                         len(producer.weights.tracker.in_flight)
                         - producer.weights.tracker.pending_prefills() >= GROUP_SIZE,
                         "running requests", timeout=120)
            assert engine.get_num_unfinished_requests() > 0
            ptask.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ptask
            assert not producer.weights.tracker.in_flight
            await settle(lambda: engine.get_num_unfinished_requests() == 0,
                         "the engine to drop the aborted requests", timeout=10)
            assert not learner.groups  # nothing half-done was sent

    loop.run_until_complete(asyncio.wait_for(scenario(), 200))
    engine.shutdown()
    assert_no_children()
