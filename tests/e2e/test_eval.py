"""End to end: evaluation during training and of a checkpoint, through the real launcher with a
real vLLM CPU engine on the tiny model.

Checks: eval rows appear for the due versions (every 2nd, and the last), with the version they
measure; evaluation completions never reach the rollout buffer (the learner received exactly the
groups the producer sent); ``pipeline-train eval --checkpoint`` evaluates the final checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow



def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_eval_during_training_and_of_a_checkpoint(tiny_model, tmp_path):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "prompt_id": f"heldout-{a}"})
            + "\n"
            for a in range(5)
        )
    )
    run_dir = tmp_path / "run"
    proc = pipeline_train(
        *tiny_args(tiny_model, run_dir, data="arithmetic:64", group_size=2),
        "--mode", "async", "--max-staleness", "1", "--steps", "4", "--name", "eval-e2e",
        "--eval.data", str(heldout), "--eval.every", "2", "--eval.samples_per_prompt", "3",
        "--eval.max_prompts", "3", "--eval.pass_threshold", "0.0",
        tag="eval",
    )

    rows = _rows(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/version" in r]
    # steps 1..3 publish v1..v3 (none after step 4): due are v0, v2 and the last, v3.
    assert sorted(int(r["eval/version"]) for r in evals) == [0, 2, 3], evals
    for r in evals:
        assert r["eval/prompts"] == 3.0
        assert r["eval/pass@3"] == 1.0  # threshold 0: every exact_match score (0 or 1) passes
        assert 0.0 <= r["eval/reward_mean"] <= 1.0
        assert r["eval/exact_match"] == pytest.approx(r["eval/reward_mean"])
        assert r["eval/tokens"] > 0
        assert "reward_mean" not in r  # an eval row is not a training step's row
    train = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert "eval v3: reward" in proc.stdout + proc.stderr

    # Conservation: evaluation completions never reach the buffer. 3 samples per held-out
    # prompt, not the group size 2, so one sent as a group would be rejected (and counted).
    last = train[-1]
    assert all(r.get("rejected_groups", 0) == 0 for r in train)
    assert last["received"] == 4 * 2 + last["dropped_stale"] + last["buffer_size"]
    sent = [
        json.loads(line)
        for f in (run_dir / "producers").glob("*.jsonl")
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    seqs = sorted(s["seq"] for s in sent if "seq" in s)
    assert seqs == list(range(len(seqs))) and len(seqs) >= last["received"]

    # The final checkpoint alone: same figures, through `pipeline-train eval`.
    out = tmp_path / "ckpt_eval.json"
    proc = pipeline_train("eval", "--checkpoint", str(run_dir), "--out", str(out), tag="eval")
    result = json.loads(out.read_text())
    assert result["step"] == 4 and result["version"] == 3
    assert result["eval/prompts"] == 3.0 and result["eval/pass@3"] == 1.0
    assert "reward_mean" in proc.stdout and str(out) in proc.stdout
    # As quiet as training: the engine's INFO lines are in the run's logs/eval.log only.
    shown = (proc.stdout + proc.stderr).splitlines()
    assert not [x for x in shown if "INFO" in x], shown
    assert "INFO" in (run_dir / "logs" / "eval.log").read_text()

    bad = pipeline_train("eval", "--checkpoint", str(run_dir),
                         "--set", "eval.data=" + str(tmp_path / "missing.jsonl"),
                         tag="eval", timeout=120, returncode=2)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "eval.data" in bad.stderr


def test_a_dedicated_evaluator_in_sync_mode_then_killed(tiny_model, tmp_path):
    """eval.producer dedicated, sync mode: the evaluator evaluates due versions with its own
    engine, each at most once; producer 0 never evaluates; nothing of it enters the buffer; every
    step trains without waiting for it. Then kill -9 of the evaluator: one error line, no restart
    left, the run goes on training (two more steps after the line, then Ctrl-C), and nothing of
    it is left running. (That the last version is always evaluated: the Ray test below.) The run
    has no last step of its own: the kill cannot race with its end."""
    import os
    import re
    import signal

    from tests.e2e.support.launcher import ENGINE_START_S, Launcher, assert_gone

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                               for a in range(5)))
    run_dir = tmp_path / "run"
    la = Launcher(tiny_model, run_dir, "--num-producers", "1", "--data", "arithmetic:64",
                  "--group-size", "2", "--mode", "sync", "--steps", "100000",
                  "--eval.data", str(heldout), "--eval.every", "1",
                  "--eval.samples_per_prompt", "2", "--eval.max_prompts", "3",
                  "--eval.pass_threshold", "0.0", "--eval.timeout_s", "20",
                  "--eval.producer", "dedicated")

    def rows() -> list[dict]:
        path = run_dir / "metrics.jsonl"
        return _rows(path) if path.exists() else []

    try:
        pattern = re.compile(r"evaluator eval \(pid (\d+)\) connected")
        pid = la.wait_for(lambda: next((int(m[1]) for ln in la.lines
                                        if (m := pattern.search(ln))), None),
                          ENGINE_START_S, "the evaluator's Hello")
        la.wait_for(lambda: any("eval/version" in r for r in rows()), ENGINE_START_S,
                    "the evaluator's first evaluation")
        os.kill(pid, signal.SIGKILL)
        la.wait_for(lambda: any("the evaluator died" in ln for ln in la.lines), 120,
                    "the launcher to report the evaluator's death")
        target = len([r for r in rows() if "reward_mean" in r]) + 2
        la.wait_for(lambda: len([r for r in rows() if "reward_mean" in r]) >= target, 300,
                    "two more steps after the death")
    finally:
        la.stop()  # Ctrl-C: the final checkpoint, then every process stops
    died = [ln for ln in la.lines if "the evaluator died" in ln]
    assert len(died) == 1 and "training goes on without evaluation" in died[0], la.tail()
    assert_gone(la.descendants, "the run's processes")

    all_rows = rows()
    train = [r for r in all_rows if "reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    evals = [r for r in all_rows if "eval/version" in r]
    versions = [int(r["eval/version"]) for r in evals]
    assert versions and len(set(versions)) == len(versions), versions  # each at most once
    assert max(versions) <= train[-1]["version"]
    for r in evals:
        # (pass@k at threshold 0 is 1 with exact_match alone: the test above; the launcher here
        # adds length_reward, which scores below 0.)
        assert r["eval/prompts"] == 3.0 and 0.0 <= r["eval/pass@2"] <= 1.0, json.dumps(evals)
        assert r["eval/versions_behind"] >= 0
    assert all("evaluator_alive" in r for r in train)
    logs = run_dir / "logs"
    assert f"eval v{versions[0]}" in (logs / "evaluator.log").read_text()
    assert "eval v" not in (logs / "producer-0.log").read_text()  # producer 0 never paused
    # Nothing of the evaluator reaches the buffer; every step trained its batch of p0's groups.
    last = train[-1]
    assert all(r.get("rejected_groups", 0) == 0 and "rejected/from_evaluator" not in r
               for r in train)
    assert last["received"] == last["step"] * 2 + last["dropped_stale"] + last["buffer_size"]
    assert all(r.get("producers_acked", 1.0) <= 1.0 for r in train)  # p0's ack only


@pytest.mark.ray
def test_a_dedicated_evaluator_under_the_ray_launcher(tiny_model, tmp_path):
    """--launcher ray (a private node): the evaluator is one more producer actor, placed and
    reported; it evaluates the last version and the run ends clean."""
    pytest.importorskip("ray")
    from tests.e2e.support.launcher import ENGINE_START_S, Launcher
    from tests.e2e.support.ray_runs import ray_args, stop_and_keep_log

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    run_dir = tmp_path / "run"
    la = Launcher(tiny_model, run_dir, *ray_args(
        None, "--num-producers", "1", "--mode", "async", "--steps", "3",
        "--eval.data", str(heldout), "--eval.every", "2", "--eval.max_prompts", "1",
        "--eval.producer", "dedicated"))
    try:
        assert la.wait(ENGINE_START_S) == 0, la.tail()
    finally:
        log = stop_and_keep_log(la, tmp_path / "console.log")
    assert "ray: evaluator on node" in log and "evaluator pid" in log, log[-3000:]
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]
    assert 2 in [int(r["eval/version"]) for r in rows if "eval/version" in r]  # the last
    assert "eval v2" in (run_dir / "logs" / "evaluator.log").read_text()
