"""Episode logic without an engine: the transcript's masks and version tags, the limits
(turns, tokens, context, tool and episode timeouts), conversation extension, rewards from the
return value, and the wire/learner handling of masked spans. The engine is replaced by
``fake_generate`` (a scripted stand-in that returns fixed tokens at a given version)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from producer_fakes import CharTokenizer

from buffer.schema import Completion, RolloutGroup, decode, encode, span_error
from pipeline.learner.batching import collate, pack_groups
from pipeline.producer.episode import (
    EpisodeContext,
    EpisodeLimits,
    Transcript,
    environment_episode,
    episode_reward,
    extension,
    load_episode,
    run_episode,
    turn_budget,
)
from pipeline.tasks.calculator import calc
from pipeline.tasks.calculator import episode as calculator_episode
from pipeline.tasks.feedback import GuessEnv


def fake_generate(script: list[str], version: list[int], calls: list):
    """A scripted engine: turn k answers script[k] (cut at max_tokens) at version[0]."""

    async def generate(rid, prompt_ids, sampling):
        calls.append((rid, list(prompt_ids), dict(sampling)))
        text = script[min(len(calls) - 1, len(script) - 1)]
        text = text[: sampling["max_tokens"]]
        ids = [ord(c) for c in text]
        comp = Completion(
            token_ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.5, np.float32),
            version_segments=[(0, version[0])],
            finish_reason="stop",
        )
        return comp, text

    return generate


def _ctx(script, version=None, calls=None, limits=None, context_left=1000, prompt="Q:"):
    version = version if version is not None else [0]
    return EpisodeContext(
        generate=fake_generate(script, version, calls if calls is not None else []),
        tokenizer=CharTokenizer(),
        prompt_ids=[ord(c) for c in prompt],
        limits=limits or EpisodeLimits(4, 64, 1.0, 10.0),
        context_left=context_left,
        request_prefix="g-0",
        version=lambda: version[0],
        prompt_id="p1",
    )


# ------------------------------------------------------------------ transcript
def test_transcript_masks_env_tokens_and_keeps_versions_non_decreasing():
    t = Transcript()
    gen = Completion(np.asarray([1, 2, 3], np.int32), np.full(3, -0.1, np.float32), [(0, 2)])
    t.add_generated(gen)
    t.add_env([7, 8], version=5)  # tagged with the last token's version (2), not 5
    t.add_env([9], version=5)  # adjacent spans merge
    later = Completion(np.asarray([4, 5], np.int32), np.full(2, -0.2, np.float32), [(0, 3), (1, 4)])
    t.add_generated(later)
    c = t.completion(version=9)
    assert c.token_ids.tolist() == [1, 2, 3, 7, 8, 9, 4, 5]
    assert c.masked_spans == [(3, 6)]
    assert c.loss_mask().tolist() == [True] * 3 + [False] * 3 + [True] * 2
    assert c.per_token_versions().tolist() == [2, 2, 2, 2, 2, 2, 3, 4]
    assert c.logprobs[3:6].tolist() == [0.0, 0.0, 0.0]
    assert t.turns == 2 and t.generated_tokens == 5


def test_transcript_refuses_a_version_going_back():
    t = Transcript()
    t.add_generated(Completion(np.asarray([1], np.int32), np.zeros(1, np.float32), [(0, 3)]))
    with pytest.raises(ValueError, match="must not go back"):
        t.add_generated(Completion(np.asarray([2], np.int32), np.zeros(1, np.float32), [(0, 2)]))


def test_turn_budget():
    lim = EpisodeLimits(max_turns=2, max_tokens=10, tool_timeout_s=1, timeout_s=1)
    assert turn_budget(lim, 0, 0, 100) == 10
    assert turn_budget(lim, 1, 7, 100) == 3
    assert turn_budget(lim, 1, 7, 8) == 1  # the context is the tighter limit
    assert turn_budget(lim, 2, 0, 100) == 0  # turns spent
    assert turn_budget(lim, 1, 12, 100) == 0


def test_extension():
    assert extension([1, 2], [1, 2, 3, 4]) == [3, 4]
    assert extension([], [5]) == [5]
    with pytest.raises(ValueError, match="position 1"):
        extension([1, 2, 3], [1, 9, 3, 4])
    with pytest.raises(ValueError, match="does not extend"):
        extension([1, 2, 3], [1, 2])


def test_episode_reward():
    assert episode_reward(None) is None
    assert episode_reward(1) == (1.0, {"episode": 1.0})
    assert episode_reward({"a": 1, "b": 0.5}) == (1.5, {"a": 1.0, "b": 0.5})
    with pytest.raises(ValueError):
        episode_reward(float("nan"))
    with pytest.raises(TypeError):
        episode_reward("yes")


# ------------------------------------------------------------------ the context and limits
def test_generate_continues_the_transcript_and_caps_max_tokens():
    calls: list = []
    ctx = _ctx(["abc", "xyz"], calls=calls, limits=EpisodeLimits(4, 64, 1.0, 10.0))

    async def ep(ctx, prompt, **meta):
        await ctx.generate()
        await ctx.generate(" tool:42 ", max_tokens=100)
        return None

    r = asyncio.run(run_episode(ep, ctx, "Q:", {}))
    assert r.failure == "" and r.turns == 2
    # Turn 2 sees prompt + turn 1 + the environment text; it may generate what is left of 8.
    assert calls[1][1] == [ord(c) for c in "Q:abc tool:42 "]
    assert calls[1][2]["max_tokens"] == 64 - 3 - 9  # what is left, not the 100 asked for
    assert r.text == "abc tool:42 xyz" and r.completion.masked_spans == [(3, 12)]
    assert [c[0] for c in calls] == ["g-0-t0", "g-0-t1"]


def test_max_tokens_cuts_env_output_and_ends_the_episode():
    ctx = _ctx(["abcd"], limits=EpisodeLimits(4, 6, 1.0, 10.0))

    async def ep(ctx, prompt, **meta):
        await ctx.generate()
        ctx.append("0123456789")  # only 2 tokens fit
        await ctx.generate()  # nothing left: EpisodeOver
        raise AssertionError("not reached")

    r = asyncio.run(run_episode(ep, ctx, "Q:", {}))
    assert r.failure == "" and r.text == "abcd01"
    assert r.completion.masked_spans == [(4, 6)] and r.env_tokens == 2


def test_max_turns_ends_the_episode_normally():
    ctx = _ctx(["a"], limits=EpisodeLimits(2, 64, 1.0, 10.0))

    async def ep(ctx, prompt, **meta):
        while True:
            await ctx.generate(" more ")

    r = asyncio.run(run_episode(ep, ctx, "Q:", {}))
    assert r.failure == "" and r.turns == 2 and r.reward is None


def test_a_hanging_sync_tool_times_out_and_fails_the_episode():
    ctx = _ctx(["a"], limits=EpisodeLimits(4, 64, tool_timeout_s=0.2, timeout_s=10.0))

    def hang():
        time.sleep(30)

    async def ep(ctx, prompt, **meta):
        await ctx.generate()
        await ctx.tool(hang)

    t0 = time.monotonic()
    r = asyncio.run(run_episode(ep, ctx, "Q:", {}))
    assert time.monotonic() - t0 < 5  # the daemon thread is abandoned, not joined
    assert r.failure == "tool_timeout" and "tool_timeout_s" in r.detail
    assert r.text == "a" and r.tool_calls == 1


def test_a_raising_async_tool_fails_the_episode():
    ctx = _ctx(["a"])

    async def broken(x):
        raise KeyError(x)

    async def ep(ctx, prompt, **meta):
        return await ctx.tool(broken, "k")

    r = asyncio.run(run_episode(ep, ctx, "Q:", {}))
    assert r.failure == "tool_error" and "KeyError" in r.detail


def test_episode_timeout_and_episode_errors_are_contained():
    ctx = _ctx(["a"], limits=EpisodeLimits(4, 64, 1.0, timeout_s=0.1))

    async def slow(ctx, prompt, **meta):
        await asyncio.sleep(10)

    r = asyncio.run(run_episode(slow, ctx, "Q:", {}))
    assert r.failure == "timeout"

    async def buggy(ctx, prompt, **meta):
        await ctx.generate()
        return "not a reward"

    r = asyncio.run(run_episode(buggy, _ctx(["a"]), "Q:", {}))
    assert r.failure == "error" and r.text == "a"


def test_a_version_change_between_turns_tags_later_tokens():
    version = [3]

    async def ep(ctx, prompt, **meta):
        await ctx.generate()
        ctx.append("|")
        version[0] = 4  # a swap between the turns
        await ctx.generate()
        return 1.0

    r = asyncio.run(run_episode(ep, _ctx(["ab", "cd"], version=version), "Q:", {}))
    c = r.completion
    assert c.per_token_versions().tolist() == [3, 3, 3, 4, 4]
    assert c.version_segments == [(0, 3), (3, 4)] and c.oldest_version == 3
    assert r.reward == (1.0, {"episode": 1.0})


def test_a_token_conversation_must_extend_the_transcript():
    async def ep(ctx, prompt, **meta):
        await ctx.generate()
        await ctx.generate(ctx.prompt_ids + ctx.token_ids + [ord("!")])
        await ctx.generate([1, 2, 3])  # rewrites history: an error in the episode

    r = asyncio.run(run_episode(ep, _ctx(["ab"]), "Q:", {}))
    assert r.failure == "error" and "does not extend" in r.detail
    assert r.text == "ab!ab" and r.completion.masked_spans == [(2, 3)]


# ------------------------------------------------------------------ the calculator example
def test_calc_is_safe_arithmetic():
    assert calc("12 + 7") == "19"
    assert calc("(3+4)*-2") == "-14"
    assert calc("7/2") == "3.5"
    with pytest.raises(ValueError):
        calc("__import__('os')")
    with pytest.raises(ValueError):
        calc("9**99999")


def test_calculator_episode_opens_with_calc_calls_the_tool_then_answers():
    calls: list = []
    ctx = _ctx(["12+7)", " 19"], calls=calls)
    r = asyncio.run(run_episode(calculator_episode, ctx, "What is 12 + 7?", {"answer": "19"}))
    assert r.failure == "" and r.turns == 2 and r.tool_calls == 1
    assert r.text == "calc(12+7)\nresult: 19\nanswer:  19"
    assert r.reward is not None and r.reward[0] == 1.0
    # "calc(" and the tool's answer are environment text: masked, out of the loss.
    spans = r.completion.masked_spans
    assert spans == [(0, 5), (10, 10 + len("\nresult: 19\nanswer: "))], spans
    assert calls[0][1][-5:] == [ord(c) for c in "calc("]  # the first turn continues it


def test_calculator_episode_without_start_leaves_the_call_to_the_model():
    ctx = _ctx(["19"])
    r = asyncio.run(
        run_episode(calculator_episode, ctx, "What is 12 + 7?", {"answer": "19", "start": ""})
    )
    assert r.turns == 1 and r.tool_calls == 0 and r.text == "19"
    assert r.reward is not None and r.reward[0] == 1.0 and not r.completion.masked_spans
    wrong = asyncio.run(run_episode(calculator_episode, _ctx(["12+7)", " 20"]),
                                    "What is 12 + 7?", {"answer": "19"}))
    assert wrong.reward is not None and wrong.reward[0] == 0.0


# ------------------------------------------------------------------ environment classes
def test_environment_class_plays_the_guessing_game_like_the_coroutine():
    fn = load_episode("pipeline.tasks.feedback:GuessEnv")
    calls: list = []
    ctx = _ctx(["5", "9", "7"], calls=calls)
    r = asyncio.run(run_episode(fn, ctx, "What is 3 + 4?", {"answer": "7"}))
    assert r.failure == "" and r.turns == 3 and r.reward is not None
    assert r.reward[0] == pytest.approx(1 / 3)
    assert r.text == "5\nToo low. Try again: 9\nToo high. Try again: 7"
    assert len(r.completion.masked_spans) == 2  # the environment's feedback, out of the loss
    assert r.tool_calls == 4  # reset and each step ran like a tool (under its timeout)


class SilentEnv:
    """Never scores: the run's reward functions score the transcript."""

    def reset(self, prompt, **meta):
        return "go: "

    async def step(self, reply):
        return None, None, len(reply) > 0


class BadStepEnv:
    def reset(self, prompt, **meta):
        return None

    def step(self, reply):
        return "only one value"


class HangingEnv:
    def reset(self, prompt, **meta):
        return None

    def step(self, reply):
        time.sleep(30)


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, prompt, **meta):
        return None

    def step(self, reply):
        return None, 0.0, True


class NoStep:
    def reset(self, prompt, **meta):
        return None


def test_environment_without_rewards_leaves_scoring_to_the_reward_functions():
    r = asyncio.run(run_episode(environment_episode(SilentEnv), _ctx(["ok"]), "Q", {}))
    assert r.failure == "" and r.reward is None and r.text == "go: ok"
    assert r.completion.masked_spans == [(0, 4)]


def test_environment_limits_end_the_episode_with_the_rewards_so_far():
    class Endless(GuessEnv):
        def step(self, reply):
            return " more", 0.25, False

    ctx = _ctx(["a"], limits=EpisodeLimits(3, 64, 1.0, 10.0))
    r = asyncio.run(run_episode(environment_episode(Endless), ctx, "Q", {"answer": "1"}))
    assert r.failure == "" and r.turns == 3 and r.reward is not None and r.reward[0] == 0.75


def test_environment_faults_fail_the_episode_like_a_tool():
    bad = asyncio.run(run_episode(environment_episode(BadStepEnv), _ctx(["x"]), "Q", {}))
    assert bad.failure == "error" and "must return (observation, reward, done)" in bad.detail
    ctx = _ctx(["x"], limits=EpisodeLimits(4, 64, 0.2, 10.0))
    t0 = time.monotonic()
    hung = asyncio.run(run_episode(environment_episode(HangingEnv), ctx, "Q", {}))
    assert hung.failure == "tool_timeout" and time.monotonic() - t0 < 5


def test_load_episode_names_what_an_environment_class_lacks():
    with pytest.raises(ValueError, match="needs step"):
        load_episode(f"{__file__}:NoStep")
    with pytest.raises(ValueError, match="built with no arguments"):
        load_episode(f"{__file__}:NeedsArgs")
    with pytest.raises(ValueError, match="or a class with reset"):
        load_episode("pipeline.tasks.calculator:calc")


# ------------------------------------------------------------------ wire and learner
def _episode_group() -> RolloutGroup:
    comps = [
        Completion(
            np.arange(10, 18, dtype=np.int32),
            np.full(8, -0.3, np.float32),
            [(0, 1), (5, 2)],
            reward=float(i),
            masked_spans=[(2, 5)],
        )
        for i in range(2)
    ]
    return RolloutGroup("g", "p0", "q", np.arange(1, 5, dtype=np.int32), comps)


def test_masked_spans_round_trip_and_single_turn_frames_do_not_carry_them():
    g = _episode_group()
    assert decode(encode(g)) == g
    plain = RolloutGroup(
        "g",
        "p0",
        "q",
        np.arange(1, 5, dtype=np.int32),
        [Completion(np.arange(3, dtype=np.int32), np.zeros(3, np.float32), [(0, 0)])] * 2,
    )
    assert b"masked_spans" not in encode(plain)
    assert decode(encode(plain)) == plain


@pytest.mark.parametrize("spans", [[(2, 2)], [(3, 9)], [(4, 6), (5, 7)], [(5, 6), (1, 2)]])
def test_bad_masked_spans_are_refused(spans):
    assert span_error(spans, 8)
    g = _episode_group()
    g.completions[0].masked_spans = spans
    with pytest.raises(ValueError, match="masked_spans"):
        encode(g)


def test_the_learner_leaves_masked_tokens_out_of_the_loss():
    pb = pack_groups([_episode_group()], scale_rewards=True, std_eps=1e-6)
    b = collate(pb, [0, 1], pad_id=0)
    p = 4
    # Token p + k is predicted at position p + k - 1: tokens 2..4 of the completion are masked.
    assert b["mask"][0, :8].tolist() == b["select"][0, p - 1 : p - 1 + 8].tolist() == [
        True,
        True,
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    assert np.isfinite(b["behaviour"][0].numpy()).sum() >= 5


# ------------------------------------------------------------------ the feedback game
def test_feedback_game_rewards_the_turn_of_the_right_answer():
    from pipeline.tasks.feedback import episode as feedback_episode

    calls: list = []
    ctx = _ctx(["15", "21", "19"], calls=calls, limits=EpisodeLimits(3, 64, 1.0, 10.0))
    r = asyncio.run(run_episode(feedback_episode, ctx, "What is 12 + 7?", {"answer": "19"}))
    assert r.failure == "" and r.turns == 3 and r.reward == (1 / 3, {"episode": 1 / 3})
    assert r.text == "15\nToo low. Try again: 21\nToo high. Try again: 19"
    assert len(r.completion.masked_spans) == 2

    ctx = _ctx(["7"], limits=EpisodeLimits(2, 64, 1.0, 10.0))
    r = asyncio.run(run_episode(feedback_episode, ctx, "Q", {"answer": "19"}))
    assert r.turns == 2 and r.reward == (0.0, {"episode": 0.0})


def test_failure_log_warns_for_the_first_few_then_counts_by_kind():
    import logging

    from pipeline.producer.episode import FailureLog

    f = FailureLog(first=2)
    assert f.summary(0) is None
    assert f.record("a", "tool_error", "tool x raised") == (
        logging.WARNING, "prompt a: episode failed (tool_error): tool x raised")
    level, message = f.record("b", "timeout", "slow")
    assert level == logging.WARNING and message.endswith("each one in the log file)")
    assert f.summary(1) is None  # nothing was logged quietly yet
    assert f.record("c", "tool_error", "d")[0] == logging.INFO
    assert f.record("d", "tool_error", "d")[0] == logging.INFO
    assert f.record("e", "error", "d")[0] == logging.INFO
    assert f.summary(2) == ("3 more episodes failed (error 1, tool_error 2) up to learner "
                            "version 2; 5 in all, each one in the log file")
    assert f.summary(3) is None
    f.record("f", "timeout", "d")
    assert f.summary(4).startswith("1 more episode failed (timeout 1)")
