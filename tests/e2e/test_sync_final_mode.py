"""FINAL_ONLY streaming (the producer's default): engine progress is read from vLLM's request
state, and a swap under load still tags every token with the weights that produced it.

Checked by effect with greedy decoding: the new weights have the final norm zeroed, so every logit
is 0 and greedy picks token 0 at every step. A completion whose swap boundary is at token n must
then hold token 0 from n on, and its token n-1 (from the old weights) must not be 0.
"""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
from conftest import assert_no_children

from bench.sync_bench import model_tensors
from pipeline.producer.engine import engine_progress
from sync.barrier import RequestTracker, SwapBarrier
from sync.routes.file import FileRoute
from sync.snapshot import write_snapshot
from tests.e2e.support.engine_loop import EngineLoop

pytestmark = pytest.mark.slow


async def _final(engine, tracker, rid: str, prompt: list[int], max_tokens: int):
    """One FINAL_ONLY request, resubmitted like the producer's when a drain aborts it (it had
    not started at the swap)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for attempt in range(10):
        req = f"{rid}-a{attempt}"
        v0 = await tracker.admit(req)
        try:
            async for out in engine.generate({"prompt_token_ids": prompt,
                                              "cache_salt": f"v{v0}"}, sp, req):
                tokens, finish = list(out.outputs[0].token_ids), out.outputs[0].finish_reason
            if finish != "abort":
                return tokens, tracker.segments(req, v0, len(tokens))
        finally:
            tracker.finish(req)
    raise AssertionError(f"{rid}: aborted 10 times")


@pytest.fixture(scope="module")
def engine(tiny_model):
    """One engine for both modes: each test first swaps the base weights back in."""
    e = EngineLoop(tiny_model)
    try:
        yield e
    finally:
        e.close()
    assert_no_children()


@pytest.mark.parametrize("mode", ["drain_prefill", "keep"])
def test_final_mode_swap_tags_tokens_by_effect(tiny_model, tmp_path, mode, engine):
    e = engine
    base = dict(model_tensors(tiny_model))
    new = dict(base)
    new["model.norm.weight"] = new["model.norm.weight"] * 0
    base_v, new_v = e.next_version(), e.next_version()
    tr = FileRoute(e.engine)
    # The base weights, loaded while the engine is idle (the other mode's test left v_new's).
    e.run(tr.stage(write_snapshot(base, base_v, tmp_path / "base")))
    e.run(tr.apply(base_v))
    ref = write_snapshot(new, new_v, tmp_path / "new")
    prompts = [[65 + (i * 7 + k) % 26 for k in range(40 + 13 * i)] for i in range(24)]

    async def scenario():
        tracker = RequestTracker(probe=partial(engine_progress, e.engine), version=base_v)
        barrier = SwapBarrier(e.engine, tracker, mode=mode)
        tasks = [asyncio.create_task(_final(e.engine, tracker, f"{mode}{i}", p, 160))
                 for i, p in enumerate(prompts)]
        await asyncio.sleep(0.5)
        report = await barrier.swap(new_v, partial(tr.apply, new_v),
                                    prepare=partial(tr.stage, ref))
        return await asyncio.gather(*tasks), report

    results, report = e.run(scenario(), timeout=600)
    assert report.ok, report.error
    spanning = 0
    for tokens, segs in results:
        assert len(tokens) == 160
        assert segs[0][0] == 0 and [v for _, v in segs] == sorted(v for _, v in segs)
        start_new = dict((v, n) for n, v in segs).get(new_v)
        if start_new is None:
            continue
        assert all(t == 0 for t in tokens[start_new:]), f"a token tagged v{new_v} is not: {segs}"
        if start_new > 0:
            spanning += 1
            assert tokens[start_new - 1] != 0, f"a v{new_v} token was tagged v{base_v}: {segs}"
    assert spanning >= 3, "too few completions spanned the swap to check anything"
