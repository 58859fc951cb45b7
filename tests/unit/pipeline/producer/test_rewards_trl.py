"""TRL GRPOTrainer reward functions, written exactly in TRL's documented shape, plug in unchanged.

The fixtures below follow the examples of TRL's "Using a custom reward function" section
(reward by token count, by character count, a conversational format reward, a reference-based
accuracy reward with a ``ground_truth`` column, and the multi-task pair that returns ``None``
for samples of the other task). Real asyncio, threads and a spawn process pool; no mocks.
"""

import asyncio
import re

import pytest

from pipeline.config import RewardSpec
from pipeline.producer.rewards.call import trl_kwargs
from pipeline.producer.rewards.loading import call_mode
from pipeline.producer.rewards.runner import RewardSet

HERE = __file__


# ------------------------------------------------------- rewards in TRL's documented shape


def reward_num_tokens(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in tokens)."""
    return [float(len(ids)) for ids in completion_ids]


def reward_num_chars(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in characters)."""
    return [float(len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format (conversational)."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def boxed_reward(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for _prompt, completion, t in zip(prompts, completions, task, strict=True):
        if t == "math":
            rewards.append(1.0 if "4" in completion else -1.0)
        else:
            rewards.append(None)  # not a math sample: not scored by this function
    return rewards


def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for _prompt, completion, t in zip(prompts, completions, task, strict=True):
        if t == "code":
            rewards.append(1.0 if "def " in completion else -1.0)
        else:
            rewards.append(None)
    return rewards


async def async_trl_reward(completions, **kwargs):
    await asyncio.sleep(0.001)
    return [1.0 if "yes" in c else 0.0 for c in completions]


class TRLClassReward:
    """A TRL reward as a callable object (TRL accepts any callable)."""

    __name__ = "TRLClassReward"

    def __init__(self, word="ok"):
        self.word = word

    def __call__(self, completions, **kwargs):
        return [float(c.count(self.word)) for c in completions]


def seen_kwargs(prompts, completions, completion_ids, **kwargs):
    """Records what it was called with (module global: the thread executor shares it)."""
    CALLS.append(
        {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs}
    )
    return [0.0] * len(completions)


CALLS: list = []


def wrong_length(completions, **kwargs):
    return [1.0]


def native_none(prompt, completion, **meta):
    return None


def native_len(prompt, completion, **meta):
    return float(len(completion))


def _score(specs, prompt, completions, meta, ids=None, **kw):
    async def go():
        with RewardSet(specs, **kw) as rs:
            return await rs.score_group(prompt, completions, meta, completion_ids=ids), rs.stats

    return asyncio.run(go())


# ------------------------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "fn, batched, style, expected",
    [
        (reward_num_tokens, False, "auto", "trl"),
        (reward_num_chars, False, "auto", "trl"),
        (math_reward_func, False, "auto", "trl"),
        (TRLClassReward, False, "auto", "trl"),
        (native_len, False, "auto", "single"),
        (native_len, True, "auto", "batched"),
        (lambda prompts, completions, metas: [0.0], True, "auto", "batched"),
        (lambda prompts, completions, metas: [0.0], False, "auto", "single"),
        (reward_num_chars, False, "native", "single"),
        (native_len, False, "trl", "trl"),
    ],
)
def test_call_mode_detection(fn, batched, style, expected):
    spec = RewardSpec(fn=fn, style=style)
    assert call_mode(spec, fn, batched) == expected


def test_style_validation():
    with pytest.raises(ValueError, match="style: must be auto, native or trl"):
        RewardSpec(fn=native_len, style="openai")
    with pytest.raises(ValueError, match="leave batched unset"):
        RewardSpec(fn=reward_num_chars, style="trl", batched=True)


# ------------------------------------------------------------------------- TRL's examples


def test_token_and_char_length_rewards():
    res, _ = _score(
        [RewardSpec(fn=reward_num_tokens), RewardSpec(fn=reward_num_chars)],
        "The sky is",
        [" blue.", " in the sky."],
        {"prompt_id": "p"},
        ids=[[6303, 13], [304, 279, 12884, 13]],
    )
    assert [b["reward_num_tokens"] for b in res.breakdown] == [2.0, 4.0]
    assert [b["reward_num_chars"] for b in res.breakdown] == [6.0, 12.0]
    assert res.total == [8.0, 16.0] and not res.failed


def test_conversational_prompt_gives_message_completions():
    prompt = [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}]
    good = "<think>3 times 4 is 12.</think><answer>12</answer>"
    res, _ = _score([RewardSpec(fn=format_reward_func)], prompt, [good, "12"], {})
    assert res.total == [1.0, 0.0] and not res.failed


def test_reference_column_reaches_the_reward():
    res, _ = _score(
        [RewardSpec(fn=boxed_reward)],
        "Solve 2x + 3 = 7.",
        [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."],
        {"ground_truth": "2"},
    )
    assert res.total == [1.0, 0.0]


def test_multi_task_none_means_not_scored():
    """TRL's multi-task pair: each scores its own task and returns None for the other. The
    weighted sum covers only the rewards that scored a completion (TRL's nansum); the breakdown
    leaves the unscored reward out, so per-reward means skip it."""
    specs = [RewardSpec(fn=math_reward_func, weight=2.0), RewardSpec(fn=coding_reward_func)]
    res, stats = _score(specs, "What is 2+2?", ["4", "5"], {"task": "math"})
    assert res.total == [2.0, -2.0] and not res.failed
    assert res.breakdown == [{"math_reward_func": 1.0}, {"math_reward_func": -1.0}]
    assert stats["reward/coding_reward_func/unscored"] == 2
    assert stats["reward/coding_reward_func/failures"] == 0
    assert stats["reward/unscored_completions"] == 0

    res, stats = _score(specs, "Write add(a, b).", ["def add(a, b): ...", "no"], {"task": "code"})
    assert res.total == [1.0, -1.0]
    assert res.breakdown == [{"coding_reward_func": 1.0}, {"coding_reward_func": -1.0}]


def test_completion_no_reward_scored_totals_zero_and_is_counted():
    res, stats = _score(
        [RewardSpec(fn=math_reward_func)], "sort a list", ["a", "b", "c"], {"task": "sorting"}
    )
    assert res.total == [0.0, 0.0, 0.0] and res.breakdown == [{}, {}, {}]
    assert not res.failed and stats["reward/unscored_completions"] == 3


def test_kwargs_are_trl_shaped():
    CALLS.clear()
    _score(
        [RewardSpec(fn=seen_kwargs)],
        "2+2?",
        ["4", "5"],
        {"answer": "4", "prompt_id": "q7"},
        ids=[[52], [53]],
    )
    (call,) = CALLS
    assert call["prompts"] == ["2+2?", "2+2?"]
    assert call["completions"] == ["4", "5"]
    assert call["completion_ids"] == [[52], [53]]
    assert call["answer"] == ["4", "4"] and call["prompt_id"] == ["q7", "q7"]
    assert call["completion_index"] == [0, 1]


def test_trl_kwargs_conversational():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kw = trl_kwargs(prompt, ["a", "b"], [{"x": 1}, {"x": 1}], None)
    assert kw["prompts"] == [prompt, prompt]
    assert kw["completions"] == [
        [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}],
    ]
    assert "completion_ids" not in kw and kw["x"] == [1, 1]


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_async_and_class_rewards(executor):
    specs = [
        RewardSpec(fn=async_trl_reward, executor=executor),
        RewardSpec(fn=TRLClassReward, kwargs={"word": "ok"}, executor=executor),
    ]
    res, _ = _score(specs, "q", ["yes ok ok", "no"], {})
    assert res.breakdown == [
        {"async_trl_reward": 1.0, "TRLClassReward": 2.0},
        {"async_trl_reward": 0.0, "TRLClassReward": 0.0},
    ]


def test_process_executor_runs_trl_reward_by_path():
    specs = [
        RewardSpec(fn=f"{HERE}:math_reward_func", executor="process"),
        RewardSpec(fn=f"{HERE}:reward_num_tokens", executor="process"),
    ]
    res, stats = _score(
        specs, "What is 2+2?", ["4", "x"], {"task": "math"}, ids=[[1], [1, 2]], pool_workers=1
    )
    assert res.total == [2.0, 1.0]
    assert stats["reward/math_reward_func/failures"] == 0


def test_wrong_length_is_a_failure():
    res, stats = _score([RewardSpec(fn=wrong_length)], "q", ["a", "b"], {})
    assert res.failed and res.total == [0.0, 0.0]
    assert stats["reward/wrong_length/failures"] == 1


def test_none_from_a_native_reward_is_a_failure():
    res, stats = _score([RewardSpec(fn=native_none)], "q", ["a"], {})
    assert res.failed and stats["reward/native_none/failures"] == 1


def test_trainer_reward_means_skip_unscored():
    """The learner's per-reward mean is over the completions each reward scored."""
    np = pytest.importorskip("numpy")
    from buffer.schema import Completion, RolloutGroup
    from pipeline.learner.step_metrics import reward_means

    def comp(breakdown):
        return Completion(
            token_ids=np.zeros(1, np.int32),
            logprobs=np.zeros(1, np.float32),
            version_segments=[(0, 0)],
            reward=0.0,
            reward_breakdown=breakdown,
        )

    g = RolloutGroup(
        group_id="g",
        producer_id="p",
        prompt_id="q",
        prompt_token_ids=np.zeros(1, np.int32),
        completions=[comp({"math": 1.0}), comp({"math": 0.0}), comp({})],
    )
    assert reward_means([g]) == {"reward/math": 0.5}
