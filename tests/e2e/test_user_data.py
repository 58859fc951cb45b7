"""End to end: a TRL-style reward file and a conversational Parquet dataset, as users bring them
from TRL, train through the real launcher with a real vLLM CPU engine on the tiny model."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from tests.e2e.support.train_run import SMALL_ENGINE, pipeline_train

pytestmark = pytest.mark.slow


# Written exactly in TRL's documented reward shape; each call is logged so the test can check
# what the producer passed.
REWARDS = """
import json

LOG = {log!r}


def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if s in c else 0.0 for c, s in zip(contents, solution)]


def math_only_reward(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if any(ch.isdigit() for ch in completion[0]["content"]) else -1.0)
        else:
            rewards.append(None)
    return rewards


def reward_len(completion_ids, **kwargs):
    with open(LOG, "a") as fh:
        fh.write(json.dumps({{"n": len(completion_ids), "ids": completion_ids,
                             "columns": sorted(kwargs)}}) + "\\n")
    return [-abs(8 - len(ids)) / 8 for ids in completion_ids]
"""


def test_trl_rewards_on_conversational_parquet(tiny_model, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "messages": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "solution": str(a + b),
            "task": "math" if a % 3 else "chat",
        }
        for a in range(1, 13)
        for b in (2, 5)
    ]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    log = tmp_path / "calls.jsonl"
    (tmp_path / "trl_rewards.py").write_text(REWARDS.format(log=str(log)))
    rfile = tmp_path / "trl_rewards.py"
    config = {
        "data": {"path": str(data), "prompt_field": "messages", "answer_field": "solution"},
        "rewards": {
            "specs": [
                {"fn": f"{rfile}:accuracy_reward"},
                {"fn": f"{rfile}:math_only_reward", "weight": 0.5},
                {"fn": f"{rfile}:reward_len", "style": "trl"},
            ]
        },
    }
    # The learner's trackers, where installed (pip install -e .[trackers]): wandb offline and
    # mlflow's file store in the run directory.
    trackers = [t for t in ("wandb", "mlflow") if importlib.util.find_spec(t) is not None]
    config["report_to"] = ["tensorboard", *trackers]
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    pipeline_train(
        "--config", str(cfg_file), "--model", str(tiny_model), "--mode", "sync", "--steps", "2",
        "--num-producers", "1", "--batch-groups", "4", "--group-size", "4", "--max-tokens", "8",
        "--run-dir", str(run_dir), *SMALL_ENGINE, "--name", "trl-e2e",
        tag="trl", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""},
    )

    metrics = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert {"reward/accuracy_reward", "reward/reward_len"} <= set(m), sorted(m)
        assert 0.0 <= m["reward/accuracy_reward"] <= 1.0
        assert -1.0 <= m["reward/reward_len"] <= 0.0
    # A math-only reward is present whenever a math prompt was trained, and its mean is over
    # math completions only (never a None coerced to 0: it is -1 or 1 per completion).
    seen = [m["reward/math_only_reward"] for m in metrics if "reward/math_only_reward" in m]
    assert seen and all(-1.0 <= v <= 1.0 for v in seen)

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) >= 8  # one call per group: 2 steps x 4 groups
    assert all(c["n"] == 4 for c in calls)  # the group's G completions at once
    assert all(
        len(ids) >= 1 and all(isinstance(t, int) for t in ids) for c in calls for ids in c["ids"]
    )
    # TRL's kwargs: prompts, completions, and the dataset's columns (the prompt field excluded).
    assert {"prompts", "completions", "solution", "task", "answer"} <= set(calls[0]["columns"])
    assert "messages" not in calls[0]["columns"]

    # Trackers: TensorBoard events, and every step's scalars in mlflow under the run's name.
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    if "wandb" in trackers:
        assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    if "mlflow" in trackers:
        import mlflow

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reading a file store
        client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("pipeline-grpo").experiment_id])
        assert run.info.run_name == "trl-e2e" and run.data.params["train.steps"] == "2"
        for key in ("reward_mean", "reward/accuracy_reward", "grad_norm"):
            hist = client.get_metric_history(run.info.run_id, key.replace("/", "."))
            assert sorted(m.step for m in hist) == [1, 2], key
            assert [m.value for m in sorted(hist, key=lambda m: m.step)] == [
                row[key] for row in metrics
            ]
