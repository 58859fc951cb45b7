"""Multi-turn episodes end to end: `pipeline-train` (real launcher, a real vLLM CPU engine on
the tiny model, async mode) runs two-turn episodes around a slow tool, so the learner's
snapshots land while episodes are between turns, and a tool that hangs for some prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow

EPISODES = Path(__file__).resolve().parent / "episodes.py"


def test_multi_turn_episodes_swap_between_turns_and_a_hanging_tool(tiny_model, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "episodes.jsonl"
    kwargs = json.dumps({"log": str(log), "tool_delay_s": 1.0, "hang_every": 3})
    pipeline_train(
        *tiny_args(tiny_model, run_dir, group_size=3),
        "--reward", "pipeline.tasks.rewards:length_reward",
        "--mode", "async", "--max-staleness", "2", "--steps", "4",
        "--episode.fn", f"{EPISODES}:two_turns", "--episode.kwargs", kwargs,
        "--episode.max_tokens", "40", "--episode.tool_timeout_s", "3",
        # Blocks of 32 tokens (the CPU default is 128): the short transcripts fill some, so
        # the prefix cache has something to serve.
        "--engine.extra", '{"block_size": 32}',
        "--tensorboard", "false",
        tag=run_dir.name,
    )  # fmt: skip

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the run went on past the hung tools
    last = rows[-1]
    assert last["producer/episodes"] >= 2 * 3 * 4 / 2
    assert last["producer/episode_tool_timeouts"] >= 1  # counted, episode scored 0
    assert last["producer/episode_env_tokens"] > 0
    assert last["producer/episode_turns"] > last["producer/episodes"]
    # Later turns re-send the transcript: some of it comes from the prefix cache.
    assert 0 < last["producer/prompt_tokens_cached"] < last["producer/prompt_tokens"]

    episodes = [json.loads(x) for x in log.read_text().splitlines()]
    hung = [e for e in episodes if len(e["versions"]) == 1]
    assert hung and all(e["index"] == 0 for e in hung)
    two = [e for e in episodes if len(e["versions"]) == 2]
    assert two and all(e["masked_spans"] for e in two)
    for e in two:  # versions never go back across or within turns
        flat = e["versions"][0] + e["versions"][1]
        assert flat == sorted(flat), e
    # A snapshot landed while an episode was under way (generating its first turn, or
    # waiting for its tool): its later tokens carry the newer version (the second turn is
    # admitted through the barrier's gate, after the swap).
    swapped = [e for e in two if max(e["versions"][1]) > min(e["versions"][0])]
    assert swapped, [e["versions"] for e in two]
