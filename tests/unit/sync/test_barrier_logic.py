"""RequestTracker + SwapBarrier protocol logic against a fake engine (pure, no vLLM).

The fake engine records pause/resume calls and can hang or fail on purpose; the real-engine
behaviour is covered by tests/e2e/test_sync_swap.py.
"""

from __future__ import annotations

import asyncio

import pytest

from sync.barrier import RequestTracker, SwapBarrier


class FakeEngine:
    def __init__(self, *, pause_hangs: bool = False, resume_fails: bool = False):
        self.paused = False
        self.calls: list[str] = []
        self.pause_hangs, self.resume_fails = pause_hangs, resume_fails

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
    return SwapBarrier(engine, RequestTracker(), mode=mode, **kw)  # type: ignore[arg-type]


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
        eng = FakeEngine()
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
        b = _barrier(FakeEngine())
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
        eng = FakeEngine(pause_hangs=step == "pause")
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
        eng = FakeEngine()
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
