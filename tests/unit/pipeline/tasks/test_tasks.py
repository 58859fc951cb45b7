"""Example task: arithmetic prompt generator, JSONL writer/CLI, and the example rewards."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import RewardSpec
from pipeline.producer.rewards.runner import RewardSet
from pipeline.tasks.arithmetic import make_arithmetic_prompts, write_jsonl
from pipeline.tasks.rewards import exact_match, format_reward, length_reward

REPO_ROOT = Path(__file__).resolve().parents[4]


def test_prompts_are_deterministic_and_correct():
    a = make_arithmetic_prompts(200, seed=3, max_operand=20, ops="+-*")
    assert a == make_arithmetic_prompts(200, seed=3, max_operand=20, ops="+-*")
    assert a != make_arithmetic_prompts(200, seed=4, max_operand=20, ops="+-*")
    assert len({r["prompt_id"] for r in a}) == 200
    for r in a:
        assert set(r) == {"prompt_id", "prompt", "answer"}
        q = r["prompt"].removeprefix("What is ").removesuffix("? Answer with just the number.")
        x, op, y = q.split(" ")
        u, v = int(x), int(y)
        assert 0 <= u <= 20 and 0 <= v <= 20
        assert int(r["answer"]) == {"+": u + v, "-": u - v, "*": u * v}[op] >= 0
    assert {r["prompt"].split(" ")[3] for r in a} == {"+", "-", "*"}


def test_default_is_addition_with_plain_phrasing():
    (r,) = make_arithmetic_prompts(1, seed=0)
    assert r["prompt"].startswith("What is ") and " + " in r["prompt"]
    assert r["prompt"].endswith("? Answer with just the number.")


@pytest.mark.parametrize("kwargs", [{"n": -1}, {"ops": "/"}, {"ops": ""}, {"max_operand": -1}])
def test_prompt_argument_validation(kwargs):
    args = {"n": 1, "seed": 0, **kwargs}
    with pytest.raises(ValueError):
        make_arithmetic_prompts(**args)


def test_write_jsonl_and_cli(tmp_path):
    recs = make_arithmetic_prompts(3, seed=1)
    path = write_jsonl(tmp_path / "sub" / "a.jsonl", recs)
    assert [json.loads(line) for line in path.read_text().splitlines()] == recs
    out = tmp_path / "cli.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tasks.arithmetic", "--n", "7", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    )
    assert "wrote 7 prompts" in proc.stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 7
    assert json.loads(lines[0]) == make_arithmetic_prompts(7, seed=0)[0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("19", 1.0),
        (" 19\n", 1.0),
        ("19. Because 12 + 7 is 19.", 1.0),
        ("The answer is 19", 1.0),
        ("12 + 7 = 19", 1.0),  # restating the sum: the integer after '=' is the answer
        ("12 + 7 = 9", 0.0),
        ("12 + 7 = 19. And 19 + 1 = 20", 1.0),  # only the first '=' counts
        ("9", 0.0),
        ("", 0.0),
        ("nineteen", 0.0),
        ("1,9", 1.0),  # thousands separators are removed before matching
    ],
)
def test_exact_match(completion, expected):
    assert exact_match("What is 12 + 7?", completion, answer="19", prompt_id="x") == expected


def test_exact_match_without_usable_answer():
    assert exact_match("p", "19") == 0.0
    assert exact_match("p", "19", answer="n/a") == 0.0
    assert exact_match("p", "-3", answer="-3") == 1.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("19", 1.0), (" 19. ", 1.0), ("It is 19.", 0.5), ("no digits here", 0.0),
     ("The answer to this question is 19", 0.0)],
)
def test_format_reward(completion, expected):
    assert format_reward("p", completion) == expected


def test_length_reward_matches_trl_blog():
    assert length_reward("p", "x" * 20) == 0.0
    assert length_reward("p", "x" * 5) == -15.0
    assert length_reward("p", "x" * 31) == -11.0


def test_examples_load_as_reward_specs():
    specs = [
        RewardSpec(fn="pipeline.tasks.rewards:exact_match"),
        RewardSpec(fn="pipeline.tasks.rewards:format_reward", weight=0.5),
        RewardSpec(fn="pipeline.tasks.rewards:length_reward", weight=0.01),
    ]
    (rec,) = make_arithmetic_prompts(1, seed=0)
    meta = {k: v for k, v in rec.items() if k != "prompt"}
    with RewardSet(specs) as rs:
        res = asyncio.run(rs.score_group(rec["prompt"], [rec["answer"], "I do not know"], meta))
    n = len(rec["answer"])
    assert res.total[0] == pytest.approx(1.0 + 0.5 - 0.01 * (20 - n))
    assert res.breakdown[1]["exact_match"] == 0.0
    assert not res.failed
