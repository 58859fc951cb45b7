"""The producer role's evaluation: its pure parts (pass@k, aggregation, held-out records, an
episode evaluation on a fake engine) and the dedicated evaluator's choice of versions (pure
control logic: generation and the weight swap are fakes that record the versions asked for; the
endpoint records what it sends)."""

from __future__ import annotations

import asyncio
import json

import pytest
from producer_fakes import CharTokenizer, RecordingEndpoint

import pipeline.producer.evaluation as evaluation_mod
import pipeline.producer.weights as weights_mod
from buffer.protocol import Announce, EvalResult, Hello, decode, encode
from pipeline.config import DataConfig, EvalConfig, load_config
from pipeline.options import ConfigError
from pipeline.producer.evaluation import Evaluator, aggregate, eval_records, pass_at_k
from pipeline.schedule import EVALUATOR_ID
from sync.barrier import SwapReport
from tests.waiting import settle


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
    from pipeline.config import EpisodeConfig, RewardSpec
    from pipeline.producer.episode import load_episode
    from pipeline.producer.evaluation import EpisodeRun, generate_and_score
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


# ------------------------------------------------------------------ the dedicated evaluator


def _announce(version: int) -> Announce:
    uri = f"file:///snap/v{version}.safetensors" if version else ""  # v0: the base weights
    return Announce(version=version, snapshot_uri=uri, snapshot_checksum="c" if version else "",
                    learner_session="s", received={}, consumed={})


@pytest.fixture
def fakes(monkeypatch):
    """Generation waits for a permit per evaluation; a swap sets the tracker's version."""
    calls: list[int] = []
    loads: list[int] = []
    permits: asyncio.Queue = asyncio.Queue()

    async def generate_and_score(engine, tokenizer, data, ev, max_tokens, max_model_len,
                                 records, rewards, version, lora_request=None, episodes=None):
        calls.append(version)
        await permits.get()
        return {"eval/reward_mean": 0.5, "eval/seconds": 0.25}

    async def swap_with_fallback(barrier, route, ref, file, load=None, prepare=None):
        assert route == "file" and ref.uri  # the evaluator loads files only
        loads.append(ref.version)
        barrier.tracker.version = ref.version
        return SwapReport(ref.version, True)

    monkeypatch.setattr(evaluation_mod, "generate_and_score", generate_and_score)
    monkeypatch.setattr(weights_mod, "swap_with_fallback", swap_with_fallback)
    return calls, loads, permits


def test_takes_the_newest_due_version_once_free_and_counts_the_skipped(tmp_path, fakes):
    calls, loads, permits = fakes
    # every 2nd of versions 0..7 (8 steps, a version per step) and the last: 0, 2, 4, 6, 7.
    cfg = load_config(overrides={"run_dir": str(tmp_path), "train.steps": 8,
                                 "eval.data": "arithmetic:8", "eval.every": 2,
                                 "eval.producer": "dedicated"})
    endpoint = RecordingEndpoint()
    ev = Evaluator(cfg, None, None, endpoint, None)

    def announce(v: int) -> None:
        ev.latest = _announce(v)
        ev._announced.set()

    async def run() -> None:
        task = asyncio.create_task(ev._evaluate_versions())
        try:
            announce(0)
            await settle(lambda: calls == [0], "v0's evaluation", timeout=2.0)
            for v in (1, 2, 3, 4):  # announced while v0 is evaluated
                announce(v)
            permits.put_nowait(1)
            await settle(lambda: calls == [0, 4], "v4's evaluation (v2 skipped)", timeout=2.0)
            announce(5)
            await asyncio.sleep(0.05)  # not due: nothing happens
            assert calls == [0, 4]
            announce(7)
            permits.put_nowait(1)
            await settle(lambda: calls == [0, 4, 7], "v7's, the last (v6 skipped)", timeout=2.0)
            permits.put_nowait(1)
            await settle(lambda: len([m for m in endpoint.sent
                                      if isinstance(m, EvalResult)]) == 3, "three results",
                         timeout=2.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    results = [m for m in endpoint.sent if isinstance(m, EvalResult)]
    assert [r.version for r in results] == [0, 4, 7]
    assert all(r.producer_id == EVALUATOR_ID for r in results)
    assert [r.stats["eval/versions_behind"] for r in results] == [4.0, 3.0, 0.0]
    assert loads == [4, 7]  # v0 runs on the engine's own weights: nothing loaded
    assert ev.stats["versions_skipped"] == 2 and ev.stats["evaluations"] == 3
    assert ev.stats["swaps"] == 2 and ev.stats["eval_s"] == 0.75
    assert not [m for m in endpoint.sent if isinstance(m, Hello)]  # the learner knew it


def _v2_then_a_restarted_learners_v2(tmp_path, fakes, snapshot_uri: str | None) -> None:
    """The dedicated evaluator hears v2, evaluates it, then hears v2 of a restarted learner
    (another session; ``snapshot_uri``: another file too) and must evaluate it again."""
    calls, _loads, permits = fakes
    cfg = load_config(overrides={"run_dir": str(tmp_path), "train.steps": 3,
                                 "eval.data": "arithmetic:8", "eval.every": 1,
                                 "eval.producer": "dedicated"})
    endpoint = RecordingEndpoint()
    queue: asyncio.Queue = asyncio.Queue()

    async def recv_announce(timeout: float = 1.0):
        try:
            return await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            return None

    endpoint.recv_announce = recv_announce
    ev = Evaluator(cfg, None, None, endpoint, None)

    async def run() -> None:
        tasks = [asyncio.create_task(ev._listen()), asyncio.create_task(ev._evaluate_versions())]
        try:
            queue.put_nowait(_announce(2))
            permits.put_nowait(1)
            await settle(lambda: calls == [2], "v2's evaluation", timeout=2.0)
            restarted = _announce(2)
            restarted.learner_session = "s2"
            if snapshot_uri is not None:
                restarted.snapshot_uri = snapshot_uri
            queue.put_nowait(restarted)
            permits.put_nowait(1)
            await settle(lambda: calls == [2, 2], "v2 of the new learner evaluated", timeout=2.0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_a_restarted_learner_gets_its_versions_evaluated_again(tmp_path, fakes):
    """The learner restarted from an older checkpoint and trains v2 again: new weights under an
    old number, so the evaluator evaluates it again rather than skip it as done."""
    _v2_then_a_restarted_learners_v2(tmp_path, fakes, None)


def test_after_a_learner_restart_a_version_held_by_number_is_loaded_again(tmp_path, fakes):
    """The engine holds v2 of the learner before its restart; the restarted learner trains v2
    anew (another file, other weights): the evaluator loads it before evaluating, rather than
    report the old weights' figures under its number."""
    _v2_then_a_restarted_learners_v2(tmp_path, fakes, "file:///snap/s2/v2.safetensors")
    assert fakes[1] == [2, 2]  # the restarted learner's v2 loaded before its evaluation
