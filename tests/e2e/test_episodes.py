"""Multi-turn episodes end to end: `pipeline-train` (real launcher, a real vLLM CPU engine on
the tiny model, async mode) runs two-turn episodes around a slow tool, so the learner's
snapshots land while episodes are between turns, and a tool that hangs for some prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_process_left

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EPISODES = Path(__file__).resolve().parent / "episodes.py"


def test_multi_turn_episodes_swap_between_turns_and_a_hanging_tool(tiny_model, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "episodes.jsonl"
    kwargs = json.dumps({"log": str(log), "tool_delay_s": 1.0, "hang_every": 3})
    cmd = [
        sys.executable,
        "-m",
        "pipeline.launch.cli",
        "--model",
        str(tiny_model),
        "--data",
        "arithmetic:200",
        "--reward",
        "pipeline.tasks.rewards:length_reward",
        "--num-producers",
        "1",
        "--batch-groups",
        "2",
        "--group-size",
        "3",
        "--max-tokens",
        "8",
        "--mode",
        "async",
        "--max-staleness",
        "2",
        "--steps",
        "4",
        "--episode.fn",
        f"{EPISODES}:two_turns",
        "--episode.kwargs",
        kwargs,
        "--episode.max_tokens",
        "40",
        "--episode.tool_timeout_s",
        "3",
        "--run-dir",
        str(run_dir),
        "--engine.max_model_len",
        "256",
        "--engine.cpu_kvcache_space_gib",
        "1",
        # Blocks of 32 tokens (the CPU default is 128): the short transcripts fill some, so
        # the prefix cache has something to serve.
        "--engine.extra",
        '{"block_size": 32}',
        "--tensorboard",
        "false",
    ]
    env = dict(os.environ, PIPELINE_TEST_RUN=run_dir.name + str(os.getpid()))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_no_process_left(env["PIPELINE_TEST_RUN"])

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
