"""The dedicated evaluator's choice of versions (pure control logic: generation and the weight
swap are fakes that record the versions asked for; the endpoint records what it sends)."""

from __future__ import annotations

import asyncio

import pytest
from producer_fakes import RecordingEndpoint

import pipeline.producer.evaluator as evaluator_mod
from buffer.protocol import Announce, EvalResult, Hello
from pipeline.config import load_config
from pipeline.producer.evaluator import Evaluator
from pipeline.schedule import EVALUATOR_ID
from sync.barrier import SwapReport


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

    monkeypatch.setattr(evaluator_mod, "generate_and_score", generate_and_score)
    monkeypatch.setattr(evaluator_mod, "swap_with_fallback", swap_with_fallback)
    return calls, loads, permits


async def _until(pred, what: str) -> None:
    for _ in range(200):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


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
            await _until(lambda: calls == [0], "v0's evaluation")
            for v in (1, 2, 3, 4):  # announced while v0 is evaluated
                announce(v)
            permits.put_nowait(1)
            await _until(lambda: calls == [0, 4], "v4's evaluation (v2 skipped)")
            announce(5)
            await asyncio.sleep(0.05)  # not due: nothing happens
            assert calls == [0, 4]
            announce(7)
            permits.put_nowait(1)
            await _until(lambda: calls == [0, 4, 7], "v7's, the last (v6 skipped)")
            permits.put_nowait(1)
            await _until(lambda: len([m for m in endpoint.sent
                                      if isinstance(m, EvalResult)]) == 3, "three results")
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


def test_a_restarted_learner_gets_its_versions_evaluated_again(tmp_path, fakes):
    """The learner restarted from an older checkpoint and trains v2 again: new weights under an
    old number, so the evaluator evaluates it again rather than skip it as done."""
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
            await _until(lambda: calls == [2], "v2's evaluation")
            restarted = _announce(2)
            restarted.learner_session = "s2"
            queue.put_nowait(restarted)
            permits.put_nowait(1)
            await _until(lambda: calls == [2, 2], "v2 evaluated again for the new learner")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
