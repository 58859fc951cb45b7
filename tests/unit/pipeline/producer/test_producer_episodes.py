"""The producer's episode hook (``GroupRollout.start`` with ``episode.fn``): what a group of
episodes sends, how its rewards are chosen, and how a failed episode is scored or drops its
group per ``rewards.on_failure``. Real RewardSet and outbox; the engine request
(``_generate_one``) and the tokenizer are fakes, named so."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from producer_fakes import Cursor, RecordingEndpoint

from buffer.protocol import Announce
from buffer.schema import Completion, RolloutGroup
from pipeline.config import load_config
from pipeline.producer.data import PromptRecord
from pipeline.producer.loop import Producer
from pipeline.producer.rewards.runner import RewardSet


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
    p.rollout.episode_fn = episode
    p.rollout._generate_one = generate_one_fake
    p.rollout._sampling = lambda **over: over
    return p, endpoint


def _run(p) -> None:
    record = PromptRecord("q1", "Q?", {}, 1)

    async def run() -> None:
        await p.rollout.start(record, [81, 63])

    asyncio.run(run())


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


def test_reward_counters_appear_only_when_the_reward_functions_run(tmp_path):
    """Episodes that return their own rewards never call rewards.specs: no reward/<name>/*
    counters in the heartbeat (they read 0 for a reward that never ran)."""
    p, _endpoint = _producer(tmp_path, scoring_episode)
    _run(p)
    assert not [k for k in p.heartbeat_stats() if k.startswith("reward/")]
    assert p.heartbeat_stats()["episodes"] == 3
    p, _endpoint = _producer(tmp_path, tool_episode)  # returns None: the reward scores it
    _run(p)
    assert p.heartbeat_stats()["reward/length_reward/calls"] == 3


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


async def broken_tool_episode(ctx, prompt, **meta):
    await ctx.generate()
    await ctx.tool(_broken)


def test_failed_episodes_show_a_few_lines_then_one_per_step_and_log_every_one(tmp_path, caplog):
    """A tool that raises in every episode: 81 failures in 3 steps printed 81 console warnings.
    Now the first 5 are warnings, the rest INFO records (the log file), and each learner step
    (a new version in the announce) adds one warning line with the count by kind."""
    caplog.set_level(logging.INFO, logger="pipeline.producer")
    p, _endpoint = _producer(tmp_path, broken_tool_episode)
    p.prompts = Cursor()

    async def run() -> None:
        for step in range(1, 4):
            for i in range(9):  # 9 groups of 3 episodes
                await p.rollout.start(PromptRecord(f"q{step}.{i}", "Q?", {}, 1), [81, 63])
            for _ in range(2):  # announces repeat every second; one summary per version
                await p._apply_announce(Announce(
                    version=step, snapshot_uri="", snapshot_checksum="", learner_session="s",
                    received={}, consumed={}))

    asyncio.run(run())
    failed = [r for r in caplog.records if "episode failed (tool_error)" in r.getMessage()]
    assert len(failed) == 81 == p.stats.episode_tool_errors  # every one in the log file
    assert [r.levelno for r in failed[:6]] == [logging.WARNING] * 5 + [logging.INFO]
    assert {r.levelno for r in failed[5:]} == {logging.INFO}
    assert "one line per step" in failed[4].getMessage()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 5 + 3, warnings
    assert warnings[5:] == [
        f"p0: {n} more episodes failed (tool_error {n}) up to learner version {v}; {total} in "
        "all, each one in the log file" for n, v, total in [(22, 1, 27), (27, 2, 54), (27, 3, 81)]
    ]
