"""Multi-turn episodes end to end: `pipeline-train` (real launcher, a real vLLM CPU engine on
the tiny model, async mode) runs two-turn episodes around a slow tool, so the learner's
snapshots land while episodes are between turns, and a tool that hangs for some prompts; and a
learner killed while episodes are in flight is restarted from its checkpoint with every group
placed (the episodes finish and their groups reach the restored learner whole)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from bench.soak import tally
from tests.e2e.support.launcher import (
    ENGINE_START_S,
    Launcher,
    assert_gone,
    read_jsonl,
    read_metrics,
)
from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow

EPISODES = Path(__file__).resolve().parent / "support" / "episodes.py"


def test_multi_turn_episodes_swap_between_turns_and_a_hanging_tool(tiny_model, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "episodes.jsonl"
    # A third of the prompts wait 6 s between their turns: a version is published while they
    # wait, whatever the machine's load (a swap landing between turns by chance was a race).
    kwargs = json.dumps({"log": str(log), "tool_delay_s": 0.5, "hang_every": 3,
                         "slow_every": 3, "slow_delay_s": 6.0})
    heldout = tmp_path / "heldout.jsonl"  # evaluated with episodes too
    heldout.write_text("".join(
        json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "prompt_id": f"heldout-{a}"})
        + "\n" for a in (1, 2)))
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
        "--eval.data", str(heldout), "--eval.every", "3", "--eval.samples_per_prompt", "2",
        tag=run_dir.name,
    )  # fmt: skip

    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/version" in r]
    rows = [r for r in rows if "eval/version" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the run went on past the hung tools
    # Evaluation ran episodes (two turns each, logged by the episode) on versions 0 and 3.
    assert sorted(int(r["eval/version"]) for r in evals) == [0, 3], evals
    assert all(r["eval/prompts"] == 2 and r["eval/tokens"] > 0 for r in evals), evals
    last = rows[-1]
    assert last["producer/episodes"] >= 2 * 3 * 4 / 2
    assert last["producer/episode_tool_timeouts"] >= 1  # counted, episode scored 0
    assert last["producer/episode_env_tokens"] > 0
    assert last["producer/episode_turns"] > last["producer/episodes"]
    # Later turns re-send the transcript: some of it comes from the prefix cache.
    assert 0 < last["producer/prompt_tokens_cached"] < last["producer/prompt_tokens"]

    episodes = read_jsonl(log)
    assert {e["prompt_id"] for e in episodes if e["prompt_id"].startswith("heldout-")} == {
        "heldout-1", "heldout-2"}
    # The first episode of every third prompt called the hanging tool: it never got a second
    # turn (other one-turn entries are episodes the run's end cancelled during their tool).
    hung = [e for e in episodes
            if e["index"] == 0 and int(e["prompt_id"].rsplit("-", 1)[-1]) % 3 == 0]
    assert hung and all(len(e["versions"]) == 1 for e in hung)
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


@pytest.mark.timeout(1800)
def test_learner_killed_mid_episode_restarts_from_its_checkpoint_nothing_half_counted(
    tiny_model, tmp_path
):
    run_dir, log = tmp_path / "resume", tmp_path / "episodes.jsonl"
    # No last step of its own (the kill cannot race with its end): Ctrl-C ends it two steps
    # after the restarted learner trained its first.
    la = Launcher(
        tiny_model, run_dir, "--num-producers", "1", "--mode", "async", "--max-staleness", "2",
        "--steps", "100000", "--train.checkpoint_every", "1", "--max-learner-restarts", "1",
        "--episode.fn", f"{EPISODES}:two_turns",
        "--episode.kwargs", json.dumps({"log": str(log), "tool_delay_s": 1.0}),
        "--episode.max_tokens", "40",
    )  # fmt: skip
    started = Path(f"{log}.started")

    def in_flight() -> int:
        def keys(path: Path) -> set[tuple[str, int]]:
            rows = read_jsonl(path)
            return {(r["prompt_id"], r["index"]) for r in rows}

        return len(keys(started) - keys(log))

    try:
        la.wait_for(
            lambda: la.steps_done() >= 2 and (run_dir / "checkpoints" / "LATEST").exists()
            and in_flight() > 0,
            ENGINE_START_S, "two steps, a checkpoint and episodes in flight",
        )  # fmt: skip
        kids = psutil.Process(la.proc.pid).children()
        producers = {pid for _p, pid, _v in la.connects()}
        learner = [c for c in kids if c.pid not in producers
                   and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(learner) == 1, [(c.pid, c.cmdline()) for c in kids]
        os.kill(learner[0].pid, signal.SIGKILL)
        flying = in_flight()
        la.wait_for(lambda: "restarting it from its last checkpoint (1/1)" in "\n".join(la.lines),
                    120, "the launcher to restart the learner")
        after = la.steps_done() + 2
        la.wait_for(lambda: la.steps_done() >= after, ENGINE_START_S,
                    "two steps after the restart")
        # The restarted learner has the producer's counters once a heartbeat reaches it (the
        # backlog of groups can train a step or two before that).
        la.wait_for(lambda: "producer/episodes" in read_metrics(run_dir)[-1], 120,
                    "a step row with the producer's counters after the restart")
        la.proc.send_signal(signal.SIGINT)  # Ctrl-C: the final checkpoint, then all stop
        code = la.wait(300)
    finally:
        la.stop()
    assert code == 130, la.tail()
    assert flying > 0

    rows = read_metrics(run_dir)
    steps = rows[-1]["step"]
    assert {r["step"] for r in rows} == set(range(1, steps + 1))
    counted = [r for r in rows if "producer/episodes" in r][-1]
    assert counted["producer/episodes"] >= 2 * 4 * counted["step"] / 2
    # Every group the producer sent (each one whole episodes) was trained, dropped as too
    # old, or is held: nothing lost or counted twice across the restart.
    t = tally(run_dir)
    assert t["lost"] == 0 and t["buffer_invariant_ok"] and t["conservation_ok"], t
    assert t["trained"] >= 2 * steps, t
    # The episodes in flight at the kill finished: each started episode that was not hung
    # ended with its two turns logged.
    done = {(e["prompt_id"], e["index"]) for e in read_jsonl(log)}
    begun = read_jsonl(started)
    assert len(done) >= len(begun) - 4, (len(done), len(begun))  # the last group may be cut
    assert_gone(la.descendants)
