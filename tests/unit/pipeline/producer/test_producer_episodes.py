"""The producer's episode hook (``Producer._run_group`` with ``episode.fn``): what a group of
episodes sends, how its rewards are chosen, and how a failed episode is scored or drops its
group per ``rewards.on_failure``. Real RewardSet and outbox; the engine request
(``_generate_one``) and the tokenizer are fakes, named so."""

from __future__ import annotations

import asyncio

import numpy as np
from producer_fakes import RecordingEndpoint

from buffer.schema import Completion, RolloutGroup
from pipeline.config import load_config
from pipeline.producer.data import PromptRecord
from pipeline.producer.loop import Producer
from pipeline.producer.rewards import RewardSet


class CharTokenizerFake:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


async def generate_one_fake(rid, prompt_ids, sp):
    """Every turn answers 'ab' at version 0."""
    comp = Completion(
        np.asarray([97, 98], np.int32), np.full(2, -0.5, np.float32), [(0, 0)], finish_reason="stop"
    )
    return comp, "ab"


async def tool_episode(ctx, prompt, **meta):
    await ctx.generate()
    if ctx.index == 1 and meta.get("fail"):
        await ctx.tool(_broken)
    ctx.append(await ctx.tool(_answer))
    await ctx.generate()
    return None


async def scoring_episode(ctx, prompt, **meta):
    await ctx.generate()
    return float(ctx.index)


def _answer():
    return "=42;"


def _broken():
    raise RuntimeError("tool down")


def _producer(tmp_path, episode, on_failure="zero", **kwargs):
    cfg = load_config(
        overrides={
            "run_dir": str(tmp_path),
            "generation.group_size": 3,
            "rewards.on_failure": on_failure,
            "rewards.specs": [{"fn": "pipeline.tasks.rewards:length_reward"}],
            "episode.fn": "pipeline.tasks.calculator:episode",
            "episode.kwargs": kwargs,
        }
    )
    endpoint = RecordingEndpoint()
    rewards = RewardSet(cfg.rewards.specs, on_failure=on_failure)
    p = Producer(cfg, 0, None, CharTokenizerFake(), endpoint, rewards, None)
    p.episode_fn = episode
    p._generate_one = generate_one_fake
    p._sampling = lambda **over: over
    return p, endpoint


def _run(p) -> None:
    record = PromptRecord("q1", "Q?", {}, 1)
    asyncio.run(p._run_group(record, [81, 63]))


def _groups(endpoint) -> list[RolloutGroup]:
    return [m for m in endpoint.sent if isinstance(m, RolloutGroup)]


def test_a_group_of_episodes_masks_tool_tokens_and_is_scored_by_the_rewards(tmp_path):
    p, endpoint = _producer(tmp_path, tool_episode)
    _run(p)
    (g,) = _groups(endpoint)
    for c in g.completions:
        assert bytes(c.token_ids.astype(np.uint8)).decode() == "ab=42;ab"
        assert c.masked_spans == [(2, 6)] and c.loss_mask().sum() == 4
        assert c.reward == -abs(20 - 8) and c.reward_breakdown == {"length_reward": -12.0}
    s = p.stats
    assert (s.episodes, s.episode_turns, s.episode_tool_calls, s.episode_env_tokens) == (
        3,
        6,
        3,
        12,
    )


def test_episode_return_values_are_the_rewards(tmp_path):
    p, endpoint = _producer(tmp_path, scoring_episode)
    _run(p)
    (g,) = _groups(endpoint)
    assert [c.reward for c in g.completions] == [0.0, 1.0, 2.0]
    assert g.completions[2].reward_breakdown == {"episode": 2.0}


def test_a_failing_tool_scores_its_episode_zero(tmp_path, caplog):
    p, endpoint = _producer(tmp_path, tool_episode, fail=True)
    _run(p)
    (g,) = _groups(endpoint)
    assert [c.reward for c in g.completions] == [-12.0, 0.0, -12.0]
    assert g.completions[1].reward_breakdown == {}
    assert p.stats.episode_tool_errors == 1
    assert "prompt q1: episode failed (tool_error)" in caplog.text


def test_a_failing_tool_drops_the_group_under_on_failure_drop(tmp_path):
    p, endpoint = _producer(tmp_path, tool_episode, on_failure="drop", fail=True)
    _run(p)
    assert _groups(endpoint) == []
    assert p.stats.groups_dropped_episode == 1 and p.stats.episode_tool_errors == 1
