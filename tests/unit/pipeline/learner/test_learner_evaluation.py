"""The learner's side of evaluation, over real ZeroMQ sockets: an EvalResult becomes one metrics
row tagged with its version, never a group; one from an unknown producer is refused."""

from __future__ import annotations

import asyncio
import json

from learner_fakes import Running, hello, make_learner

from buffer.protocol import EvalResult, Hello, Reply, Welcome
from buffer.transport import ProducerEndpoint
from pipeline.config import load_config

STATS = {"eval/reward_mean": 0.25, "eval/pass@4": 0.5, "eval/exact_match": 0.25}


def test_eval_result_is_logged_with_its_version_and_never_buffered(tiny_model, tmp_path):
    learner = make_learner(tmp_path, tiny_model, **{"eval.data": "arithmetic:8", "eval.every": 2})

    async def main():
        async with Running(learner):
            ep = ProducerEndpoint(learner.cfg.bind_addr)
            try:
                forged = EvalResult(producer_id="p0", incarnation="p0-x", version=1, stats=STATS)
                answer = await ep.call(forged, 5)
                assert isinstance(answer, Reply) and not answer.ok  # no Hello yet
                assert isinstance(await ep.call(hello(), 5), Welcome)
                msg = EvalResult(producer_id="p0", incarnation="p0-1", version=2, stats=STATS)
                assert await ep.call(msg, 5) == Reply(ok=True)
            finally:
                ep.close()

    asyncio.run(main())
    learner.metrics.close()
    assert learner.evals.evaluated == {2: STATS}
    assert len(learner.buffer) == 0 and learner.buffer.stats.received == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["eval/version"] == 2.0
    assert {k: rows[0][k] for k in STATS} == STATS and "reward_mean" not in rows[0]


def test_a_dedicated_evaluator_is_welcomed_but_is_no_producer(tiny_model, tmp_path):
    """eval.producer dedicated: the evaluator's Hello, heartbeats and results are taken; it is
    not in the producers' table (no ack awaited, no route, no share), its groups are refused,
    and each step's row says whether it is alive, with its counters."""
    import numpy as np

    from buffer.protocol import Heartbeat
    from buffer.schema import Completion, RolloutGroup
    from pipeline.schedule import EVALUATOR_ID

    learner = make_learner(tmp_path, tiny_model, **{"eval.data": "arithmetic:8", "eval.every": 1,
                                                    "eval.producer": "dedicated"})
    inc = f"{EVALUATOR_ID}-1"

    async def main():
        async with Running(learner):
            ep = ProducerEndpoint(learner.cfg.bind_addr)
            try:
                assert isinstance(await ep.call(hello(EVALUATOR_ID, inc), 5), Welcome)
                beat = Heartbeat(producer_id=EVALUATOR_ID, incarnation=inc, policy_version=3,
                                 stats={"evaluations": 2.0, "versions_skipped": 1.0})
                assert await ep.call(beat, 5) == Reply(ok=True)
                msg = EvalResult(producer_id=EVALUATOR_ID, incarnation=inc, version=3,
                                 stats=STATS)
                assert await ep.call(msg, 5) == Reply(ok=True)
                comp = Completion(token_ids=np.arange(3, dtype=np.int32),
                                  logprobs=np.full(3, -1.0, dtype=np.float32),
                                  version_segments=[(0, 0)], reward=1.0)
                await ep.send(RolloutGroup(group_id="g0", producer_id=EVALUATOR_ID,
                                           prompt_id="q",
                                           prompt_token_ids=np.arange(4, dtype=np.int32),
                                           completions=[comp] * learner.cfg.generation.group_size,
                                           metadata={"incarnation": inc, "seq": 0}))
                for _ in range(100):
                    if learner.buffer.stats.rejected:
                        break
                    await asyncio.sleep(0.05)
            finally:
                ep.close()

    asyncio.run(main())
    learner.metrics.close()
    assert learner.evals.evaluated == {3: STATS}
    assert EVALUATOR_ID not in learner.control.producers  # no ack, route, share or shard for it
    assert learner.buffer.stats.rejected == 1 and len(learner.buffer) == 0
    assert learner.control.registry.metrics() == {"rejected/from_evaluator": 1.0}
    m = learner.evals.step_metrics()
    assert m == {"evaluator_alive": 1.0, "evaluator/evaluations": 2.0,
                 "evaluator/versions_skipped": 1.0}


def test_a_shared_run_refuses_an_evaluator_and_logs_no_evaluator_keys(tiny_model, tmp_path):
    learner = make_learner(tmp_path, tiny_model, **{"eval.data": "arithmetic:8", "eval.every": 1})
    learner.metrics.close()
    assert learner.control.answer(hello("eval", "eval-1")) == \
        Reply(ok=False, reason="unexpected_producer")
    assert learner.evals.step_metrics() == {}


def test_the_final_wait_ends_when_the_evaluator_is_gone(tmp_path):
    """A dedicated evaluator heard from once, then silent past EVALUATOR_RESTART_S (dead beyond
    its restarts): the learner's final wait stops at once instead of waiting eval.timeout_s."""
    import time

    from pipeline.learner.evaluation import EVALUATOR_RESTART_S
    from pipeline.schedule import EVALUATOR_ID

    evals = _evaluator_said_hello(tmp_path)
    evals.evaluators[EVALUATOR_ID].last_seen = time.monotonic() - EVALUATOR_RESTART_S - 1
    assert evals.evaluator_gone()
    t0 = time.monotonic()
    asyncio.run(evals.await_last(2))
    assert time.monotonic() - t0 < 30  # not the 60 s eval.timeout_s


def test_the_final_wait_goes_on_while_a_restarted_evaluator_starts(tmp_path):
    """Silent past ALIVE_S because the launcher is restarting it: its evaluation of the last
    version still comes, and the wait takes it."""
    import time

    from buffer.protocol import EvalResult
    from pipeline.learner.evaluation import Evaluations
    from pipeline.learner.producers import ALIVE_S
    from pipeline.schedule import EVALUATOR_ID

    cfg = load_config(overrides={"run_dir": str(tmp_path), "train.steps": 3,
                                 "eval.data": "arithmetic:8", "eval.every": 1,
                                 "eval.producer": "dedicated", "eval.timeout_s": 30})

    class Rows:
        def log(self, step, row, progress=True):
            pass

    evals = Evaluations(cfg, metrics=Rows())
    evals.hello(Hello(producer_id=EVALUATOR_ID, incarnation="e-1", policy_version=0, pid=7),
                new=True)
    evals.evaluators[EVALUATOR_ID].last_seen = time.monotonic() - ALIVE_S - 1
    assert not evals.evaluator_gone()

    async def run() -> None:
        wait = asyncio.create_task(evals.await_last(2))
        await asyncio.sleep(0.3)
        assert not wait.done()
        evals.result(EvalResult(producer_id=EVALUATOR_ID, incarnation="e-2", version=2,
                                stats={"eval/reward_mean": 1.0}), step=3)
        await asyncio.wait_for(wait, 5)

    asyncio.run(run())
    assert 2 in evals.evaluated


def test_an_evaluator_that_just_said_hello_is_not_silent(tmp_path):
    """Its Hello counts as hearing from it: a final wait that starts right after (before the
    first heartbeat) waits for its evaluation instead of giving up at once."""
    assert not _evaluator_said_hello(tmp_path).evaluator_gone()


def _evaluator_said_hello(tmp_path):
    """Evaluations of a 3-step run with a dedicated evaluator that has just said Hello."""
    from pipeline.learner.evaluation import Evaluations
    from pipeline.schedule import EVALUATOR_ID

    cfg = load_config(overrides={"run_dir": str(tmp_path), "train.steps": 3,
                                 "eval.data": "arithmetic:8", "eval.every": 1,
                                 "eval.producer": "dedicated", "eval.timeout_s": 60})
    evals = Evaluations(cfg, metrics=None)
    evals.hello(Hello(producer_id=EVALUATOR_ID, incarnation="e-1", policy_version=0, pid=7),
                new=True)
    return evals
