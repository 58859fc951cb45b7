"""The learner's side of evaluation, over real ZeroMQ sockets: an EvalResult becomes one metrics
row tagged with its version, never a group; one from an unknown producer is refused."""

from __future__ import annotations

import asyncio
import json

from buffer.protocol import EvalResult, Hello, Reply, Welcome
from buffer.transport import ProducerEndpoint
from pipeline.config import load_config
from pipeline.learner.loop import Learner

STATS = {"eval/reward_mean": 0.25, "eval/pass@4": 0.5, "eval/exact_match": 0.25}


def test_eval_result_is_logged_with_its_version_and_never_buffered(tiny_model, tmp_path):
    cfg = load_config(
        overrides={
            "run_dir": str(tmp_path),
            "model.path": str(tiny_model),
            "num_producers": 1,
            "progress": False,
            "tensorboard": False,
            "eval.data": "arithmetic:8",
            "eval.every": 2,
        }
    )
    learner = Learner(cfg, str(tiny_model))

    async def main():
        from buffer.transport import LearnerEndpoint

        learner.endpoint = LearnerEndpoint(cfg.bind_addr)
        task = asyncio.create_task(learner._control())
        ep = ProducerEndpoint(cfg.bind_addr)
        try:
            forged = EvalResult(producer_id="p0", incarnation="p0-x", version=1, stats=STATS)
            answer = await ep.call(forged, 5)
            assert isinstance(answer, Reply) and not answer.ok  # no Hello yet
            hello = Hello(producer_id="p0", incarnation="p0-1", policy_version=0, pid=1)
            assert isinstance(await ep.call(hello, 5), Welcome)
            msg = EvalResult(producer_id="p0", incarnation="p0-1", version=2, stats=STATS)
            assert await ep.call(msg, 5) == Reply(ok=True)
        finally:
            ep.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            learner.endpoint.close()

    asyncio.run(main())
    learner.metrics.close()
    assert learner.evaluated == {2: STATS}
    assert len(learner.buffer) == 0 and learner.buffer.stats.received == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["eval/version"] == 2.0
    assert {k: rows[0][k] for k in STATS} == STATS and "reward_mean" not in rows[0]
