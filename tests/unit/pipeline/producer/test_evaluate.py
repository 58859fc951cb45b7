"""Pure parts of evaluation: pass@k, aggregation, held-out records."""

from __future__ import annotations

import json

import pytest
from producer_fakes import CharTokenizer

from buffer.protocol import EvalResult, decode, encode
from pipeline.config import DataConfig, EvalConfig, load_config
from pipeline.options import ConfigError
from pipeline.producer.evaluate import aggregate, eval_records, pass_at_k


def test_pass_at_k_counts_prompts_with_any_pass():
    assert pass_at_k([[False, True], [False, False], [True, True], [False, False]]) == 0.5
    assert pass_at_k([]) == 0.0


def test_aggregate_means_pass_at_k_and_each_reward():
    totals = [[1.0, 0.0], [0.5, 0.5]]
    breakdowns = [
        [{"acc": 1.0, "len": 0.0}, {"acc": 0.0, "len": 0.0}],
        [{"acc": 0.5}, {"acc": 0.5, "len": 1.0}],
    ]
    out = aggregate(totals, breakdowns, k=2, threshold=1.0)
    assert out["eval/reward_mean"] == pytest.approx(0.5)
    assert out["eval/pass@2"] == 0.5
    assert out["eval/acc"] == pytest.approx(0.5)
    assert out["eval/len"] == pytest.approx(1 / 3)  # over the completions it scored
    assert out["eval/prompts"] == 2.0
    assert aggregate(totals, breakdowns, k=2, threshold=0.5)["eval/pass@2"] == 1.0


def test_eval_records_use_the_data_fields_in_file_order(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text(
        "".join(json.dumps({"q": f"{i}+1=", "sol": str(i + 1)}) + "\n" for i in range(5))
    )
    data = DataConfig(prompt_field="q", answer_field="sol", seed=7)
    recs = eval_records(data, EvalConfig(data=str(path), every=1, max_prompts=3))
    assert [r.prompt for r in recs] == ["0+1=", "1+1=", "2+1="]
    assert [r.meta["answer"] for r in recs] == ["1", "2", "3"]
    assert len(eval_records(data, EvalConfig(data=str(path), every=1, max_prompts=0))) == 5


def test_eval_records_errors_name_eval_data(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval\.data: .* does not exist"):
        eval_records(DataConfig(), EvalConfig(data=str(tmp_path / "nope.jsonl"), every=1))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(ConfigError, match="prompt"):
        eval_records(DataConfig(), EvalConfig(data=str(bad), every=1))


def test_config_validation():
    with pytest.raises(ConfigError, match=r"^eval\.data: must name"):
        load_config(None, {"eval.every": 2})
    with pytest.raises(ConfigError, match=r"^eval\.every"):
        load_config(None, {"eval.every": -1, "eval.data": "x"})
    with pytest.raises(ConfigError, match=r"^eval\.samples_per_prompt"):
        load_config(None, {"eval.samples_per_prompt": 0})
    cfg = load_config(None, {"eval.every": 2, "eval.data": "arithmetic:8"})
    assert cfg.eval.every == 2 and cfg.eval.samples_per_prompt == 4


def test_eval_result_round_trips_and_refuses_non_finite():
    msg = EvalResult(
        producer_id="p0",
        incarnation="p0-1",
        version=3,
        stats={"eval/reward_mean": 0.25, "eval/pass@4": 0.5},
    )
    assert decode(encode(msg, rid=7)) == (7, msg)
    with pytest.raises(ValueError):
        encode(
            EvalResult(
                producer_id="p0",
                incarnation="p0-1",
                version=3,
                stats={"eval/reward_mean": float("nan")},
            )
        )


class FakeEngine:
    """Stands in for vLLM's AsyncLLM in this pure-logic test: every request answers "7"."""

    def __init__(self):
        self.requests = []

    async def generate(self, prompt, sp, rid, lora_request=None):
        from types import SimpleNamespace

        self.requests.append((rid, list(prompt["prompt_token_ids"]), sp))
        out = SimpleNamespace(token_ids=[55], text="7", finish_reason="stop")
        yield SimpleNamespace(outputs=[out])


def test_episode_evaluation_runs_each_sample_as_an_episode_fake_engine():
    import asyncio

    from pipeline.config import EpisodeConfig, RewardSpec
    from pipeline.producer.episode import load_episode
    from pipeline.producer.evaluate import EpisodeRun, generate_and_score
    from pipeline.producer.rewards.runner import RewardSet

    engine = FakeEngine()
    data = DataConfig(path="arithmetic:4", chat_template="none")
    ev = EvalConfig(data="arithmetic:4", every=1, samples_per_prompt=3, temperature=0.5)
    records = eval_records(data, ev)[:2]
    answers = [r.meta["answer"] for r in records]
    rewards = RewardSet([RewardSpec(fn="pipeline.tasks.rewards:length_reward")])
    run = EpisodeRun(load_episode("pipeline.tasks.feedback:GuessEnv"),
                     EpisodeConfig(max_turns=2, max_tokens=64), "zero")
    try:
        out = asyncio.run(generate_and_score(engine, CharTokenizer(), data, ev, 8, 512, records,
                                             rewards, 3, episodes=run))
    finally:
        rewards.close()
    # GuessEnv: "7" right at once scores 1, else a second turn ("7" again, still wrong) 0.
    expect = [1.0 if a == "7" else 0.0 for a in answers]
    assert out["eval/reward_mean"] == pytest.approx(sum(expect) / len(expect))
    assert out["eval/prompts"] == 2.0 and out["eval/prompts_dropped"] == 0.0
    turns = sum(1 if a == "7" else 2 for a in answers) * 3
    assert len(engine.requests) == turns
    assert all(sp.temperature == 0.5 and sp.n == 1 for _r, _p, sp in engine.requests)
    assert all(rid.startswith("eval-v3-") for rid, _p, _sp in engine.requests)
