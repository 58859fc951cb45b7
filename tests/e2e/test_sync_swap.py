"""Weight swaps on a real vLLM CPU engine (tiny model, worker extension), checked by effect.

One engine serves the whole module (start ~25 s): it lives on an event loop in a background
thread and each test submits coroutines to it. Requests are driven the way the producer drives
them (bench.sync_bench.generate: admit -> DELTA stream -> on_output -> finish, abort -> resubmit).
The last test shuts that engine down, starts a fresh one on a HF directory holding the swapped-in
weights, and checks both give the same greedy tokens and logprobs.
"""

from __future__ import annotations

import asyncio
import random
import time

import psutil
import pytest
from conftest import assert_no_children

from bench.sync_bench import generate, load_via_worker_ext, model_tensors, perturbed, random_prompt
from sync.barrier import RequestTracker, SwapBarrier
from sync.snapshot import SnapshotRef, write_snapshot
from tests.e2e.support.engine_loop import VOCAB, EngineLoop, hf_dir_with, probe

pytestmark = pytest.mark.slow

BF16_LOGPROB_TOL = 2**-5
"""Largest logprob gap between two engines on the same bf16 weights: a few bf16 roundings."""

@pytest.fixture(scope="module")
def snaps(tiny_model, tmp_path_factory):
    """Snapshots of the base weights and of a perturbed copy, plus a HF dir of the copy."""
    d = tmp_path_factory.mktemp("snapshots")
    base = model_tensors(tiny_model)
    new = perturbed(base, scale=0.5, seed=1)
    hf_new = hf_dir_with(tiny_model, new, d / "hf-perturbed")
    wrong = dict(base)
    name = "lm_head.weight"
    wrong[name] = base[name][:, :-1].contiguous()
    return {"base": write_snapshot(base, 1, d / "base"), "new": write_snapshot(new, 1, d / "new"),
            "wrong_shape": write_snapshot(wrong, 1, d / "wrong"), "hf_new": hf_new,
            "wrong_name": name}


@pytest.fixture(scope="module")
def eng(tiny_model):
    e = EngineLoop(tiny_model)
    e.tracker = RequestTracker()
    e.initial_probe = e.run(probe(e.engine, e.tracker))
    yield e
    e.close()


def _as(ref: SnapshotRef, version: int, checksum: str | None = None) -> SnapshotRef:
    return SnapshotRef(version, ref.uri, checksum or ref.checksum)


async def _load_and_swap(engine, tracker, mode, n, prompt_len, max_tokens, ref, rng,
                         min_decoding=1):
    """Start n requests, swap once some decode (and, for drain_prefill, some still prefill)."""
    barrier = SwapBarrier(engine, tracker, mode=mode, drain_timeout_s=120, pause_timeout_s=120)
    tasks = [asyncio.create_task(generate(
        engine, tracker, f"{mode}-{ref.version}-{i}",
        random_prompt(rng, rng.randint(*prompt_len), VOCAB), max_tokens=max_tokens))
        for i in range(n)]
    t0 = time.monotonic()
    while sum(tracker.in_flight.values()) < min_decoding:
        assert time.monotonic() - t0 < 120, "no request produced a token in 120 s"
        await asyncio.sleep(0.01)
    pending_at_swap = tracker.pending_prefills()
    report = await barrier.swap(ref.version, load_via_worker_ext(engine, ref))
    gens = await asyncio.gather(*tasks)
    return report, gens, pending_at_swap


def test_swap_under_load_drain_prefill(eng, snaps):
    """64 long-prompt requests, many without a first token (mid-prefill or queued); a
    drain_prefill swap loses and corrupts none (tests/e2e/test_sync_drain.py checks its KV)."""
    v0 = eng.tracker.version
    v1 = eng.next_version()
    report, gens, pending = eng.run(_load_and_swap(
        eng.engine, eng.tracker, "drain_prefill", 64, (300, 600), 32, _as(snaps["new"], v1),
        random.Random(0), min_decoding=2))
    assert report.ok, report.error
    assert pending > 0, "swap was not triggered while prefills were pending"
    assert eng.tracker.version == v1
    spanning = 0
    for g in gens:
        assert g.finish_reason == "length" and len(g.tokens) == 32
        assert all(v in (v0, v1) for v in g.versions)
        assert g.versions == sorted(g.versions), "versions are not monotone"
        spanning += g.versions[0] == v0 and g.versions[-1] == v1
    assert spanning > 0, "no request spans the swap"
    print(f"\ndrain_prefill under load: {pending} requests without a first token at the swap, "
          f"{spanning}/64 span v{v0}->v{v1}, timings "
          f"{ {k: round(v, 3) for k, v in report.timings.items()} }")


def test_broken_snapshots_are_refused_and_engine_keeps_serving(eng, snaps):
    tk = eng.tracker
    before = eng.run(probe(eng.engine, tk))
    v = tk.version
    barrier = SwapBarrier(eng.engine, tk, mode="drain_prefill", load_timeout_s=60)
    cases = {
        "wrong shape": (_as(snaps["wrong_shape"], v + 1), "wrong shape for " + snaps["wrong_name"]),
        "bad checksum": (_as(snaps["new"], v + 1, "blake2b:" + "0" * 32), "checksum mismatch"),
        "missing file": (SnapshotRef(v + 1, "/nonexistent/policy_v9.safetensors", "x"),
                         "cannot read"),
    }
    for case, (ref, expect) in cases.items():
        report = eng.run(barrier.swap(ref.version, load_via_worker_ext(eng.engine, ref)))
        assert not report.ok, case
        assert expect in report.error, f"{case}: unclear error {report.error!r}"
        assert f"swap to v{v + 1} failed" in report.error
        assert report.version == v and tk.version == v and tk.gate_open
        assert not eng.run(eng.engine.is_paused()), f"engine left paused after {case}"
        # A new request completes, on the unchanged weights.
        assert eng.run(probe(eng.engine, tk), timeout=120) == before, case
    assert barrier.failures == len(cases)


@pytest.mark.parametrize("mode", ["drain_prefill", "keep", "wait", "abort"])
def test_every_mode_swaps_under_load_without_losing_a_request(eng, snaps, mode):
    v_old = eng.tracker.version
    v_new = eng.next_version()
    ref = _as(snaps["base"] if v_new % 2 else snaps["new"], v_new)
    report, gens, _ = eng.run(_load_and_swap(
        eng.engine, eng.tracker, mode, 16, (150, 400), 32, ref, random.Random(mode)))
    assert report.ok, report.error
    assert eng.tracker.version == v_new
    for g in gens:
        assert g.finish_reason == "length" and len(g.tokens) == 32, (mode, g.finish_reason)
        assert g.versions == sorted(g.versions) and set(g.versions) <= {v_old, v_new}
        if g.resubmits:  # regenerated from scratch on the new weights, under their salt
            assert set(g.versions) == {v_new} and g.salt_version == v_new
    resubmitted = sum(g.resubmits > 0 for g in gens)
    if mode == "abort":
        assert resubmitted > 0, "abort mode aborted nothing"
    elif mode == "drain_prefill":  # only requests the scheduler had not started
        assert resubmitted == report.timings["drain_resubmitted"]
    else:
        assert resubmitted == 0
    if mode == "wait":
        assert all(len(set(g.versions)) == 1 for g in gens), "wait: a request spans the swap"
    print(f"\n{mode}: ok, {resubmitted} resubmitted, idle {report.timings['idle_s']:.3f}s")


def _tree_usage() -> tuple[int, int]:
    """RSS (bytes) of the engine's processes and open fds of this process and them."""
    me = psutil.Process()
    kids = [p for p in me.children(recursive=True) if p.is_running()]
    rss = sum(p.memory_info().rss for p in kids)
    fds = me.num_fds() + sum(p.num_fds() for p in kids)
    return rss, fds


def test_fifty_swaps_under_continuous_load_are_stable(eng, snaps):
    tk = eng.tracker
    barrier = SwapBarrier(eng.engine, tk, mode="drain_prefill", drain_timeout_s=60,
                          pause_timeout_s=60, load_timeout_s=60)

    async def main():
        stop = asyncio.Event()
        rng = random.Random(50)
        completed = [0]

        async def worker(i):
            n = 0
            while not stop.is_set():
                g = await generate(eng.engine, tk, f"load-{i}-{n}",
                                   random_prompt(rng, rng.randint(50, 200), VOCAB),
                                   max_tokens=48)
                assert len(g.tokens) == 48 and g.versions == sorted(g.versions)
                completed[0] += 1
                n += 1

        rows, usage = [], {}
        workers = [asyncio.create_task(worker(i)) for i in range(4)]
        try:
            for s in range(1, 51):
                await asyncio.sleep(0.05)
                v = eng.next_version()
                ref = _as(snaps["new"] if s % 2 else snaps["base"], v)
                rep = await barrier.swap(v, load_via_worker_ext(eng.engine, ref))
                assert rep.ok, f"swap {s}: {rep.error}"
                assert tk.version == v and sum(not w.done() for w in workers) == 4
                rows.append((s, rep.timings, len(tk.in_flight)))
                if s in (10, 50):
                    usage[s] = _tree_usage()
        finally:
            stop.set()
            await asyncio.gather(*workers)
        return rows, usage, completed[0]

    t0 = time.monotonic()
    rows, usage, completed = eng.run(main(), timeout=600)
    wall = time.monotonic() - t0
    print(f"\n50 swaps in {wall:.1f}s, {completed} requests completed meanwhile")
    print(f"{'swap':>4} {'in_flight':>9} {'drain':>7} {'pause':>7} {'load':>7} {'resume':>7} "
          f"{'idle':>7} {'total':>7}")
    for s, t, inflight in rows:
        if s % 5 == 0 or s == 1:
            print(f"{s:>4} {inflight:>9} {t['drain_s']:7.3f} {t['pause_s']:7.3f} "
                  f"{t['load_s']:7.3f} {t['resume_s']:7.3f} {t['idle_s']:7.3f} "
                  f"{t['total_s']:7.3f}")
    (rss10, fds10), (rss50, fds50) = usage[10], usage[50]
    print(f"engine RSS {rss10 / 2**20:.0f} -> {rss50 / 2**20:.0f} MiB, fds {fds10} -> {fds50}")
    assert completed > 0
    assert rss50 < rss10 * 1.15, f"engine RSS grew {rss10 / 2**20:.0f} -> {rss50 / 2**20:.0f} MiB"
    assert fds50 - fds10 < 20, f"open fds grew {fds10} -> {fds50}"


def test_swap_effect_matches_fresh_engine_on_new_weights(eng, snaps):
    """Runs last: checks by effect, then shuts the module's engine down (no children left)."""
    tk = eng.tracker
    barrier = SwapBarrier(eng.engine, tk)
    v = eng.next_version()
    rep = eng.run(barrier.swap(v, load_via_worker_ext(eng.engine, _as(snaps["base"], v))))
    assert rep.ok, rep.error
    old = eng.run(probe(eng.engine, tk))
    assert old == eng.initial_probe, "swapping the base weights back in changed the output"
    v = eng.next_version()
    rep = eng.run(barrier.swap(v, load_via_worker_ext(eng.engine, _as(snaps["new"], v))))
    assert rep.ok, rep.error
    swapped = eng.run(probe(eng.engine, tk))
    eng.close()  # one engine at a time on this machine
    assert_no_children()

    fresh_loop = EngineLoop(snaps["hf_new"])
    try:
        fresh = fresh_loop.run(probe(fresh_loop.engine, RequestTracker()))
    finally:
        fresh_loop.close()
    assert_no_children()
    assert swapped[0] == fresh[0], "greedy tokens differ from a fresh engine on the new weights"
    # Logprobs agree to bf16's resolution, not bit for bit: two engines need not split their CPU
    # kernels' sums the same way, and one bf16 rounding of a logit near 2 is 2**-7.
    gap = max(abs(a - b) for a, b in zip(swapped[1], fresh[1], strict=True))
    assert gap < BF16_LOGPROB_TOL, f"logprobs differ from a fresh engine's by {gap}"
    assert swapped[0] != old[0], "the new weights did not change the greedy tokens"
