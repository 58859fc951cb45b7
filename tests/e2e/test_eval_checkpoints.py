"""End to end: ``pipeline-train eval`` reads the checkpoint of a LoRA run and gives the same
figures as the in-training evaluation of that version, at temperature 0, through the real
launcher and a real vLLM CPU engine on the tiny model (a 2-rank ZeRO-3 run's checkpoint:
test_zero_run.py).

The reward is the completion text's crc32 (``text_rewards.fingerprint``), so equal
``eval/reward_mean`` means the engine generated the same texts from the checkpoint as from the
version the producer ran. A checkpoint after step 2 of 3 holds version 2's weights (published
after that step); the final one holds weights no producer ran, so it is not the one compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.support.launcher import read_metrics
from tests.e2e.support.train_run import pipeline_train, tiny_args

pytestmark = pytest.mark.slow


def _heldout(tmp_path: Path) -> Path:
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(
        json.dumps({"prompt": f"{a}+{a+1}=", "answer": str(2 * a + 1), "prompt_id": f"h{a}"})
        + "\n" for a in range(4)))
    return path


def _train_and_eval(tiny_model: Path, tmp_path: Path, tag: str, *extra: str,
                    env: dict[str, str] | None = None) -> tuple[dict, dict, str, str]:
    """A 3-step sync run evaluating v0 and v2 in training, then `pipeline-train eval` of its
    step-2 checkpoint; returns (in-training eval rows by version, the command's JSON, its
    stdout, the training run's stdout)."""
    run_dir = tmp_path / "run"
    train = pipeline_train(
        *tiny_args(tiny_model, run_dir, data="arithmetic:64", group_size=2),
        "--reward", "tests.e2e.support.text_rewards:fingerprint", "--mode", "sync", "--steps", "3",
        "--train.lr", "0.01", "--train.checkpoint_every", "2", "--tensorboard", "false",
        "--eval.data", str(_heldout(tmp_path)), "--eval.every", "2",
        "--eval.temperature", "0", "--eval.samples_per_prompt", "1", "--eval.max_prompts", "4",
        *extra, tag=tag, env=env)
    rows = read_metrics(run_dir)
    evals = {int(r["eval/version"]): r for r in rows if "eval/version" in r}
    assert sorted(evals) == [0, 2], sorted(evals)
    out = tmp_path / "step2_eval.json"
    proc = pipeline_train("eval", "--checkpoint", str(run_dir / "checkpoints" / "step_2"),
                          "--out", str(out), tag=tag, env=env)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    return evals, json.loads(out.read_text()), proc.stdout, train.stdout


def _check_same_as_training(evals: dict, result: dict) -> None:
    assert result["step"] == 2 and result["version"] == 2
    assert result["eval/prompts"] == evals[2]["eval/prompts"] == 4.0
    assert result["eval/reward_mean"] == pytest.approx(evals[2]["eval/reward_mean"], abs=1e-9)
    # ...and version 2 is not the base model: the checkpoint's trained weights were loaded.
    assert evals[2]["eval/reward_mean"] != pytest.approx(evals[0]["eval/reward_mean"], abs=1e-9)


def test_eval_of_a_lora_checkpoint_matches_training(tiny_model, tmp_path):
    """Also: adapters asked for (sync.lora_adapters on) at a rank vLLM cannot serve fall back to
    merged weights with one console line, from the launcher, which decides it for every role.
    alpha keeps alpha/rank at 2, so two steps change the texts as at a small rank."""
    evals, result, stdout, train_stdout = _train_and_eval(
        tiny_model, tmp_path, "evallora", "--train.lora_rank", "1024",
        "--train.lora_alpha", "2048", "--sync.lora_adapters", "on")
    assert "LoRA rank 1024 alpha 2048 (14 modules merged)" in stdout, stdout
    _check_same_as_training(evals, result)
    logs = tmp_path / "run" / "logs"
    said = [x for x in train_stdout.splitlines() if "merged full weights" in x]
    assert len(said) == 1 and "sync.lora_adapters on" in said[0], said
    assert "train.lora_rank 1024" in said[0], said
    for log in ("learner.log", "producer-0.log"):
        assert "merged full weights" not in (logs / log).read_text(errors="replace")
    producer_log = (logs / "producer-0.log").read_text(errors="replace")
    assert "serves each version as a LoRA adapter" not in producer_log
    assert "swap to v" not in producer_log
