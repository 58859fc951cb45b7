"""A drain_prefill swap behind a long prefill backlog, on a real vLLM CPU engine (tiny model).

Requests reach the scheduler in three waves, the way GRPO groups can: one member of each group
(a "leader"), then, once every leader decodes, a backlog of long distinct prompts, then the
groups' other members ("followers") at the back of the queue. The swap comes as soon as all are
submitted, so the backlog and the followers are queued, not started. The drain must wait only
for the prefills under way (not for the backlog), and every request must still complete, tagged
by version.

Prompt KV is checked by effect on each request's first token (greedy): its top-5 logprobs must
match a reference computed on the same prompt, alone and under a salt of its own, on the weights
of the version that first token is tagged with. A request that finished its prefill on the new
weights over KV of the old ones misses both references; a follower resubmitted with the old salt
would be one, since its leader left old-weights KV of their prompt in the prefix cache. That the
check sees such mixing is shown, not assumed: a request sent after the swap with the old salt
reuses the leader's KV and misses the new version's reference.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from conftest import assert_no_children

from bench.sync_bench import (
    Generation,
    generate,
    load_via_worker_ext,
    model_tensors,
    perturbed,
    random_prompt,
)
from sync.barrier import RequestTracker, SwapBarrier
from sync.snapshot import write_snapshot
from tests.e2e.support.engine_loop import VOCAB, EngineLoop

pytestmark = pytest.mark.slow

GROUPS, FOLLOWERS, BACKLOG = 4, 3, 32
GROUP_LEN, BACKLOG_LEN = 600, (1000, 1400)
MAX_TOKENS = 64
# The leaders decode long enough to still be running when the swap comes: a tiny model on an idle
# CPU finishes 64 tokens before the backlog has even arrived.
LEADER_TOKENS = 1024
TOP = 5
# Largest top-5 logprob difference still counted as "the same KV": bf16 on CPU computes a prompt
# a little differently alone and inside a batch.
SAME_KV_NATS = 0.05


async def first_top(engine, prompt: list[int], salt: str, rid: str) -> tuple[dict[int, float], int]:
    """Top-5 logprobs of a greedy first token, and how many prompt tokens came from the cache."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt, "cache_salt": salt}, sp, rid):
        final = out
    assert final is not None and final.outputs[0].logprobs, f"{rid}: no output"
    top = {int(t): float(lp.logprob) for t, lp in final.outputs[0].logprobs[0].items()}
    return top, int(final.num_cached_tokens or 0)


def top_distance(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest logprob difference over the tokens both top lists hold (inf if under 3 shared)."""
    common = a.keys() & b.keys()
    if len(common) < 3:
        return math.inf
    return max(abs(a[t] - b[t]) for t in common)


async def references(engine, prompts: list[list[int]], version: int) -> list[dict[int, float]]:
    got = await asyncio.gather(*(first_top(engine, p, f"ref-v{version}-{i}", f"ref{version}-{i}")
                                 for i, p in enumerate(prompts)))
    assert all(cached == 0 for _, cached in got), "a reference reused cached KV"
    return [top for top, _ in got]


async def scenario(engine, ref_v1):
    rng = random.Random(7)
    prompts = ([random_prompt(rng, GROUP_LEN, VOCAB) for _ in range(GROUPS)]
               + [random_prompt(rng, rng.randint(*BACKLOG_LEN), VOCAB) for _ in range(BACKLOG)])
    refs = {0: await references(engine, prompts, 0)}
    tracker = RequestTracker()
    barrier = SwapBarrier(engine, tracker, drain_timeout_s=120, pause_timeout_s=120)
    tasks: dict[str, tuple[int, asyncio.Task[Generation]]] = {}

    def start(name: str, prompt_index: int, max_tokens: int = MAX_TOKENS) -> None:
        tasks[name] = (prompt_index, asyncio.create_task(generate(
            engine, tracker, name, prompts[prompt_index], max_tokens=max_tokens,
            temperature=0.0, top_logprobs=TOP)))

    async def admitted(names: list[str]) -> None:
        """Until every named request is registered (each task has reached engine.generate)."""
        while not all(f"{n}-a0" in tracker.in_flight for n in names):
            await asyncio.sleep(0.001)

    for g in range(GROUPS):
        start(f"lead{g}", g, LEADER_TOKENS)
    t0 = time.monotonic()
    while not all(tracker.in_flight.get(f"lead{g}-a0") for g in range(GROUPS)):
        assert not any(tasks[f"lead{g}"][1].done() for g in range(GROUPS)), \
            "a leader finished before the swap could come"
        # Generous: on a machine whose cores other jobs keep busy the first tokens come late.
        assert time.monotonic() - t0 < 300, "the leaders produced no token in 300 s"
        await asyncio.sleep(0.005)
    # The backlog, then the followers, queue behind the decoding leaders while the scheduler is
    # frozen: a tiny model on an idle CPU would otherwise start much of the backlog before the
    # followers arrive, and a busy machine slows the submissions more than the engine.
    await engine.pause_generation(mode="keep", clear_cache=False)
    backlog = [f"backlog{b}" for b in range(BACKLOG)]
    for b, name in enumerate(backlog):
        start(name, GROUPS + b)
    await admitted(backlog)
    await asyncio.sleep(0.2)  # arrival order is vLLM's queue order
    followers = [f"follow{g}-{k}" for g in range(GROUPS) for k in range(FOLLOWERS)]
    for name in followers:
        start(name, int(name[6:].split("-")[0]))
    await admitted(followers)
    await asyncio.sleep(0.2)
    await engine.resume_generation()
    in_flight, pending = len(tracker.in_flight), tracker.pending_prefills()
    report = await barrier.swap(1, load_via_worker_ext(engine, ref_v1))
    # How long the queue the drain did not wait for takes to reach its first tokens.
    swapped_at = time.monotonic()
    await asyncio.sleep(0.05)  # resubmitted requests pass the reopened gate
    while tracker.pending_prefills():
        assert time.monotonic() - swapped_at < 300, "requests got no first token in 300 s"
        await asyncio.sleep(0.01)
    backlog_s = time.monotonic() - swapped_at
    gens = {name: (pi, await task) for name, (pi, task) in tasks.items()}
    refs[1] = await references(engine, prompts, 1)
    stale = await asyncio.gather(*(first_top(engine, prompts[g], "v0", f"stale{g}")
                                   for g in range(GROUPS)))
    return report, gens, refs, stale, (in_flight, pending, backlog_s)


def test_drain_waits_only_for_prefills_under_way_and_no_kv_crosses_versions(tiny_model,
                                                                           tmp_path):
    ref_v1 = write_snapshot(perturbed(model_tensors(tiny_model), scale=0.5, seed=3), 1,
                            tmp_path)
    e = EngineLoop(tiny_model)
    try:
        report, gens, refs, stale, (in_flight, pending, backlog_s) = e.run(
            scenario(e.engine, ref_v1), timeout=900)
    finally:
        e.close()
    assert_no_children()
    t = report.timings
    print(f"\nswap with {in_flight} requests in flight, {pending} without a first token: "
          f"drain {t['drain_s']:.3f}s (waited for {t['drain_waited']:.0f}, resubmitted "
          f"{t['drain_resubmitted']:.0f}), idle {t['idle_s']:.3f}s; the queue left behind "
          f"took {backlog_s:.2f}s to reach its first tokens")
    assert report.ok, report.error
    assert pending >= BACKLOG, "the swap did not come while a backlog was queued"

    # Only the prefills under way were waited for; the queue was sent back, not waited for.
    assert t["drain_waited"] <= 4, t
    resubmitted = {name for name, (_, g) in gens.items() if g.resubmits}
    assert len(resubmitted) == t["drain_resubmitted"] >= BACKLOG // 2
    assert {f"follow{g}-{k}" for g in range(GROUPS) for k in range(FOLLOWERS)} <= resubmitted
    assert t["drain_s"] < 0.25 * backlog_s, (t["drain_s"], backlog_s)

    # Every request completed, nothing lost; tokens tagged by the weights that sampled them.
    spanning = 0
    for name, (_, g) in gens.items():
        want = LEADER_TOKENS if name.startswith("lead") else MAX_TOKENS
        assert g.finish_reason == "length" and len(g.tokens) == want, name
        assert g.versions == sorted(g.versions) and set(g.versions) <= {0, 1}, name
        if name in resubmitted:  # restarted from nothing on v1, under v1's salt
            assert set(g.versions) == {1} and g.salt_version == 1, name
        else:
            assert g.salt_version == 0 and g.versions[0] == 0, name
        spanning += g.versions[0] == 0 and g.versions[-1] == 1
    assert spanning >= GROUPS, "the leaders did not decode across the swap"

    # No prompt's KV mixes versions: each first token is what its version computes alone.
    dist = {name: top_distance(g.first_top, refs[g.versions[0]][pi])
            for name, (pi, g) in gens.items()}
    worst = max(dist, key=dist.__getitem__)
    print(f"first-token top-{TOP} logprobs vs references: worst {worst} "
          f"{dist[worst]:.4f} nats")
    assert dist[worst] < SAME_KV_NATS, f"{worst}: first token does not match its version"

    # ...and the check would see it: the old salt after the swap reuses v0 KV under v1.
    for g, (top, cached) in enumerate(stale):
        assert cached > 0, "the old salt found no cached prompt KV"
        d = top_distance(top, refs[1][g])
        print(f"old salt after the swap, group {g}: {cached} cached tokens, {d:.3f} nats off v1")
        assert d > 4 * SAME_KV_NATS, f"group {g}: v0 KV under v1 weights went unnoticed"
