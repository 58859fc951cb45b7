"""RequestTracker + SwapBarrier protocol logic against a fake engine (pure, no vLLM).

The fake engine records pause/resume/abort calls, answers the drain's "which requests has the
scheduler started" RPC from a set the test controls, and can hang or fail on purpose; the
real-engine behaviour is covered by tests/e2e/test_sync_swap.py and test_sync_drain.py.
"""

from __future__ import annotations

import asyncio

import pytest

from sync.barrier import (
    RequestTracker,
    SwapBarrier,
    aborts_due,
    ours_from_engine_ids,
    split_pending,
)


class FakeEngine:
    """``started``: our ids the fake scheduler has begun (answered in vLLM's internal form);
    ``unregistered``: ids an abort does not find yet (admitted, not yet in AsyncLLM). An abort
    that finds its request ends it the way AsyncLLM does: the caller's stream ends soon after
    and it calls ``tracker.finish``."""

    def __init__(self, *, pause_hangs: bool = False, resume_fails: bool = False,
                 started: tuple[str, ...] = (), rpc_fails: bool = False):
        self.paused = False
        self.calls: list[str] = []
        self.pause_hangs, self.resume_fails = pause_hangs, resume_fails
        self.started, self.rpc_fails = set(started), rpc_fails
        self.unregistered: set[str] = set()
        self.tracker: RequestTracker | None = None

    async def collective_rpc(self, method: str) -> list[list[str]]:
        assert method == "sync_scheduled_requests"
        if self.rpc_fails:
            raise AttributeError(f"'Worker' object has no attribute '{method}'")
        return [[f"{r}-0a1b2c3d" for r in self.started]]  # one worker

    async def abort(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.calls.append("abort:" + ",".join(ids))
        assert self.tracker is not None
        for rid in ids:
            if rid not in self.unregistered:
                asyncio.get_running_loop().call_later(0.01, self.tracker.finish, rid)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}:{clear_cache}")
        self.paused = True  # like vLLM: the scheduler pauses before pause_generation returns
        if self.pause_hangs:
            await asyncio.sleep(3600)

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        if self.resume_fails:
            raise RuntimeError("engine core is gone")
        self.paused = False


def _barrier(engine: FakeEngine, mode: str = "drain_prefill", **kw) -> SwapBarrier:
    kw.setdefault("settle_s", 0.01)
    engine.tracker = RequestTracker()
    return SwapBarrier(engine, engine.tracker, mode=mode, **kw)  # type: ignore[arg-type]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_swap_ok_sets_version_and_resumes_fake_engine():
    async def main():
        eng = FakeEngine()
        b = _barrier(eng)
        seen = {}

        async def load():
            seen["paused"], seen["gate"] = eng.paused, b.tracker.gate_open
            return {"read_s": 0.5, "tensors": 3, "note": "ignored"}

        rep = await b.swap(1, load)
        return eng, b, rep, seen

    eng, b, rep, seen = _run(main())
    assert rep.ok and rep.version == 1 and rep.error == ""
    assert seen == {"paused": True, "gate": False}
    assert eng.calls == ["pause:keep:False", "resume"] and not eng.paused
    assert b.tracker.version == 1 and b.tracker.gate_open and b.swaps == 1
    for k in ("gate_s", "drain_s", "pause_s", "load_s", "resume_s", "idle_s", "total_s"):
        assert rep.timings[k] >= 0.0, k
    assert rep.timings["load_read_s"] == 0.5 and rep.timings["load_tensors"] == 3.0
    assert "load_note" not in rep.timings


def test_gate_closes_and_admit_waits_until_swap_done_fake_engine():
    async def main():
        eng = FakeEngine()
        b = _barrier(eng)
        release = asyncio.Event()

        async def load():
            await release.wait()

        swap = asyncio.create_task(b.swap(1, load))
        await asyncio.sleep(0.05)
        assert not b.tracker.gate_open
        admit = asyncio.create_task(b.tracker.admit("late"))
        await asyncio.sleep(0.05)
        assert not admit.done(), "a request was admitted while the gate was closed"
        release.set()
        rep = await swap
        version = await admit
        return rep, version

    rep, version = _run(main())
    assert rep.ok and version == 1  # the held request starts under the new version


def test_drain_waits_for_first_tokens_fake_engine():
    async def main():
        eng = FakeEngine(started=("decoding", "prefilling"))
        b = _barrier(eng)
        tk = b.tracker
        await tk.admit("decoding")
        tk.on_output("decoding", 1)
        await tk.admit("prefilling")
        assert tk.pending_prefills() == 1
        swap = asyncio.create_task(b.swap(1, lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.1)
        paused_before_first_token = bool(eng.calls)
        assert tk.on_output("prefilling", 0) == 0  # an empty delta does not count as prefilled
        await asyncio.sleep(0.05)
        still_waiting = not swap.done()
        tag = tk.on_output("prefilling", 2)  # first token: sampled by the old weights
        rep = await swap
        return eng, rep, paused_before_first_token, still_waiting, tag

    eng, rep, paused_early, still_waiting, tag = _run(main())
    assert not paused_early and still_waiting and tag == 0
    assert rep.ok and eng.calls == ["pause:keep:False", "resume"]


def test_finished_request_counts_as_drained_fake_engine():
    async def main():
        b = _barrier(FakeEngine(started=("r",)))
        await b.tracker.admit("r")
        swap = asyncio.create_task(b.swap(1, lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.05)
        b.tracker.finish("r")  # e.g. aborted or failed before its first token
        return await swap

    assert _run(main()).ok


def test_settle_tags_late_outputs_with_old_version_fake_engine():
    """Outputs arriving after pause (sampled before it) delay the version switch."""
    async def main():
        eng = FakeEngine()
        b = _barrier(eng, settle_s=0.1)
        tk = b.tracker
        await tk.admit("r")
        tk.on_output("r", 1)
        tags = []

        async def trickle():
            for _ in range(5):
                await asyncio.sleep(0.03)
                tags.append(tk.on_output("r", 1))

        tr = asyncio.create_task(trickle())
        rep = await b.swap(1, lambda: asyncio.sleep(0))
        await tr
        return rep, tags

    rep, tags = _run(main())
    assert rep.ok and tags == [0] * 5
    assert rep.timings["pause_s"] >= 0.15


def test_load_failure_reports_and_keeps_version_fake_engine():
    async def main():
        eng = FakeEngine()
        b = _barrier(eng)
        b.tracker.version = 4

        async def load():
            raise RuntimeError("snapshot v5: checksum mismatch")

        rep = await b.swap(5, load)
        return eng, b, rep

    eng, b, rep = _run(main())
    assert not rep.ok and rep.version == 4
    assert "swap to v5 failed" in rep.error and "checksum mismatch" in rep.error
    assert b.tracker.version == 4 and b.tracker.gate_open
    assert not eng.paused and eng.calls[-1] == "resume"
    assert b.failures == 1 and b.swaps == 0
    assert "total_s" in rep.timings


@pytest.mark.parametrize("step", ["drain", "pause", "load"])
def test_timeouts_are_reported_per_step_and_never_leave_paused_fake_engine(step):
    async def main():
        eng = FakeEngine(pause_hangs=step == "pause", started=("stuck-in-prefill",))
        b = _barrier(eng, drain_timeout_s=0.1, pause_timeout_s=0.1, load_timeout_s=0.1)
        if step == "drain":
            await b.tracker.admit("stuck-in-prefill")

        async def load():
            if step == "load":
                await asyncio.sleep(3600)

        rep = await b.swap(1, load)
        return eng, b, rep

    eng, b, rep = _run(main())
    assert not rep.ok and f"step '{step}' timed out after 0.1s" in rep.error
    assert b.tracker.version == 0 and b.tracker.gate_open and not b.tracker.swap_aborting
    assert not eng.paused, f"engine left paused after a {step} timeout: {eng.calls}"
    if step == "drain":
        assert eng.calls == []  # never paused at all


def test_resume_failure_is_reported_fake_engine():
    async def main():
        eng = FakeEngine(resume_fails=True)
        b = _barrier(eng)
        rep = await b.swap(1, lambda: asyncio.sleep(0))
        return b, rep

    b, rep = _run(main())
    assert not rep.ok and "engine core is gone" in rep.error
    assert b.tracker.gate_open


@pytest.mark.parametrize("mode,pause_mode", [("keep", "keep"), ("wait", "wait"),
                                             ("abort", "abort"), ("drain_prefill", "keep")])
def test_modes_map_to_pause_modes_fake_engine(mode, pause_mode):
    async def main():
        eng = FakeEngine(started=("prefilling",))
        b = _barrier(eng, mode=mode, drain_timeout_s=0.1)
        await b.tracker.admit("prefilling")  # only drain_prefill waits for it (and times out)
        seen = {}

        async def load():
            seen["aborting"] = b.tracker.swap_aborting

        rep = await b.swap(1, load)
        return eng, b, rep, seen

    eng, b, rep, seen = _run(main())
    if mode == "drain_prefill":
        assert not rep.ok and "drain" in rep.error and eng.calls == []
    else:
        assert rep.ok and eng.calls == [f"pause:{pause_mode}:False", "resume"]
        assert seen["aborting"] is (mode == "abort")
    assert not b.tracker.swap_aborting and b.tracker.gate_open and not eng.paused


def test_many_swaps_in_a_row_fake_engine():
    async def main():
        eng = FakeEngine()
        b = _barrier(eng, settle_s=0.001)
        for v in range(1, 21):
            rep = await b.swap(v, lambda: asyncio.sleep(0))
            assert rep.ok, rep.error
        return eng, b

    eng, b = _run(main())
    assert b.tracker.version == 20 and b.swaps == 20
    assert eng.calls.count("resume") == 20 and not eng.paused


# ------------------------------------------------------------------ drain: only what is mid-prefill
def test_ours_from_engine_ids_strips_vllm_suffixes():
    ours = {"g1-0-a0", "g1-1-a0", "g2-0-a1", "plain"}
    engine = ["g1-0-a0-1f2e3d4c",    # vLLM's internal id: ours + "-" + 8 random characters
              "plain",               # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
              "3_g2-0-a1-99aa88bb",  # a parallel-sampling child of g2-0-a1
              "other-1f2e3d4c",      # not ours (another caller's request)
              "g1-1-a0-short"]       # not vLLM's suffix
    assert ours_from_engine_ids(engine, ours) == {"g1-0-a0", "plain", "g2-0-a1"}
    assert ours_from_engine_ids([], ours) == set()


def test_split_pending_waits_for_started_resubmits_the_rest_in_order():
    mid, unstarted = split_pending(["c", "b", "a", "d"], {"b", "decoding", "gone"})
    assert mid == ["b"] and unstarted == ["c", "a", "d"]


def test_aborts_due_keeps_admission_order_and_retries_only_after_the_interval():
    assert aborts_due(["b", "a"], {}, now=10.0, retry_s=0.05) == ["b", "a"]
    sent = {"a": 10.0}
    assert aborts_due(["a", "b"], sent, now=10.01, retry_s=0.05) == ["b"]
    assert aborts_due(["a"], sent, now=10.06, retry_s=0.05) == ["a"]


def test_drain_waits_for_mid_prefill_and_resubmits_unstarted_fake_engine():
    """Queued requests are aborted at once (to restart under the new version); the pause waits
    only for the one whose prefill is under way."""
    async def main():
        eng = FakeEngine(started=("decoding", "mid"))
        b = _barrier(eng)
        tk = b.tracker
        for rid in ("decoding", "mid", "queued-1", "queued-2"):
            await tk.admit(rid)
        tk.on_output("decoding", 1)
        swap = asyncio.create_task(b.swap(1, lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.1)
        queued_gone = not ({"queued-1", "queued-2"} & set(tk.in_flight))
        paused_early = any(c.startswith("pause") for c in eng.calls)
        tag = tk.on_output("mid", 1)  # mid's first token, from the old weights
        rep = await swap
        return eng, rep, queued_gone, paused_early, tag

    eng, rep, queued_gone, paused_early, tag = _run(main())
    assert queued_gone and not paused_early and tag == 0
    assert rep.ok and eng.calls == ["abort:queued-1,queued-2", "pause:keep:False", "resume"]
    assert rep.timings["drain_waited"] == 1 and rep.timings["drain_resubmitted"] == 2


def test_drain_with_nothing_started_aborts_all_and_never_waits_fake_engine():
    async def main():
        b = _barrier(FakeEngine())
        for i in range(50):
            await b.tracker.admit(f"q{i}")
        return await b.swap(1, lambda: asyncio.sleep(0))

    rep = _run(main())
    assert rep.ok and rep.timings["drain_resubmitted"] == 50 and rep.timings["drain_waited"] == 0
    assert rep.timings["drain_s"] < 1.0


def test_abort_before_the_engine_knows_the_request_is_repeated_fake_engine():
    """A request admitted just before the gate closed may not have reached AsyncLLM when the
    drain aborts it; it is aborted again until it is gone, never left to start on old weights."""
    async def main():
        eng = FakeEngine()
        b = _barrier(eng, abort_retry_s=0.02)
        await b.tracker.admit("late")
        eng.unregistered.add("late")
        swap = asyncio.create_task(b.swap(1, lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.1)
        eng.unregistered.clear()  # AsyncLLM has registered it now
        return eng, await swap

    eng, rep = _run(main())
    assert rep.ok and eng.calls.count("abort:late") >= 2
    assert eng.calls[-2:] == ["pause:keep:False", "resume"]
    assert rep.timings["drain_resubmitted"] == 1


def test_drain_without_the_worker_extension_fails_clearly_fake_engine():
    async def main():
        eng = FakeEngine(rpc_fails=True)
        b = _barrier(eng)
        await b.tracker.admit("r")
        return eng, b, await b.swap(1, lambda: asyncio.sleep(0))

    eng, b, rep = _run(main())
    assert not rep.ok and "sync.worker_ext.WeightSyncExtension" in rep.error
    assert "started requests" in rep.error
    assert eng.calls == [] and b.tracker.gate_open and b.tracker.version == 0


def test_drain_probe_mode_reads_first_tokens_from_engine_state_fake_engine():
    """FINAL_ONLY streaming: first tokens come from the probe, not from output deltas."""
    async def main():
        state = {"mid": (True, 0)}
        eng = FakeEngine(started=("mid",))
        b = _barrier(eng)
        b.tracker.probe = lambda: dict(state)
        await b.tracker.admit("mid")
        await b.tracker.admit("queued")
        swap = asyncio.create_task(b.swap(1, lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.1)
        waiting = not swap.done()
        state["mid"] = (False, 1)
        return eng, waiting, await swap

    eng, waiting, rep = _run(main())
    assert waiting and rep.ok and eng.calls[0] == "abort:queued"
    assert rep.timings["drain_waited"] == 1 and rep.timings["drain_resubmitted"] == 1
