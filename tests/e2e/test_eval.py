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

    bad = pipeline_train("eval", "--checkpoint", str(run_dir),
                         "--set", "eval.data=" + str(tmp_path / "missing.jsonl"),
                         tag="eval", timeout=120, returncode=2)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "eval.data" in bad.stderr
