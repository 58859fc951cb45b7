"""Checkpoints off the training path: the host copy is the state at capture time (and the
optimiser step waits for a copy in flight), the write runs in the background one at a time (a
checkpoint due meanwhile is skipped and counted, the final one waits), ``durable`` advances only
once a write is complete, a failed write is one line and training goes on (or stops), and a
process killed (SIGKILL) mid-write leaves ``LATEST`` naming the previous, loadable checkpoint."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.learner import checkpoint as ck
from pipeline.learner.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    LearnerState,
    begin_host_copy,
    host_copy,
    latest_checkpoint,
    load_checkpoint,
    remove_partial,
)
from pipeline.learner.loop import Learner

REPO = Path(__file__).resolve().parents[4]


def _live() -> dict:
    w = torch.randn(4, 3)
    return {"model": {"w": w, "tied": w, "b": torch.arange(3)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(5.0)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0]}]},
            "scheduler": {"last_epoch": 5, "_last_lr": [1e-3]}}


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _train_on(live: dict) -> None:
    """What the next optimiser step does to the live state: everything changes in place."""
    live["model"]["w"].add_(1.0)
    live["model"]["b"].mul_(7)
    live["optimizer"]["state"][0]["exp_avg"].zero_()
    live["optimizer"]["state"][0]["step"] += 1
    live["optimizer"]["param_groups"][0]["lr"] = 5.0
    live["scheduler"]["_last_lr"].append(9.0)


def test_host_copy_is_the_state_at_capture_time():
    live = _live()
    expected = _clone(live)
    staging: dict = {}
    copy = host_copy(live, staging)
    _train_on(live)
    _assert_same(expected, copy)
    assert copy["model"]["tied"] is copy["model"]["w"]  # tied weights stay one tensor
    assert copy["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    # The next copy reuses the staged buffers (no new allocation) and holds the new state.
    again = host_copy(live, staging)
    assert again["model"]["w"].data_ptr() == copy["model"]["w"].data_ptr()
    _assert_same(_clone(live), again)


def test_host_copy_without_staging_allocates_fresh_buffers():
    live = _live()
    a, b = host_copy(live), host_copy(live)
    assert a["model"]["w"].data_ptr() != b["model"]["w"].data_ptr()
    assert a["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()


class _Gate:
    """A slow disk (test double): holds every write just before its fsync and rename, until
    opened."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.reached = threading.Event()
        real = ck._fsync_tree

        def gated(top):
            self.reached.set()
            assert self.open.wait(30), "gate never opened"
            real(top)

        monkeypatch.setattr(ck, "_fsync_tree", gated)


def _state(step: int) -> LearnerState:
    return LearnerState(step=step, version=step, received={"p0": step})


async def _until(event: threading.Event) -> None:
    for _ in range(3000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_durable_only_after_the_write_completes(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    done: list[Path] = []

    async def main():
        w = CheckpointWriter(tmp_path)
        live = _live()
        stall = await w.save(_state(1), lambda: live, b"buf", done.append)
        assert stall < 10
        parts = w.stall_parts  # where the stall went: its parts add up to it
        assert set(parts) == {"checkpoint_thread_wait_s", "checkpoint_state_s",
                              "checkpoint_copy_start_s", "checkpoint_resume_s"}
        assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= stall + 1e-6
        w.fence()  # the next optimiser step waits for the copy, then changes the state
        _train_on(live)  # training goes on while the write is held
        await _until(gate.reached)
        assert done == [] and w.busy and latest_checkpoint(tmp_path) is None
        assert w.written is None and w.completed == 0
        gate.open.set()
        assert await w.wait() == tmp_path / "checkpoints" / "step_1"
        assert done == [tmp_path / "checkpoints" / "step_1"] and not w.busy
        assert w.completed == 1 and w.write_s is not None and w.write_s > 0

    asyncio.run(main())
    state, tensors, buf = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == _state(1) and buf == b"buf"
    assert tensors["model"]["tied"].data_ptr() == tensors["model"]["w"].data_ptr()


def test_host_copy_in_flight_is_fenced_before_the_state_changes(monkeypatch):
    """A slow copy (test double for a long copy to host): ``fence`` returns only once the copy
    is complete, so a change made after it never reaches the copy."""
    release = threading.Event()
    real = ck._copy_pairs

    def slow_copy(pairs):
        assert release.wait(30)
        real(pairs)

    monkeypatch.setattr(ck, "_copy_pairs", slow_copy)
    live = _live()
    expected = _clone(live)
    copy, pending = begin_host_copy(live, {})
    fenced = threading.Thread(target=lambda: (pending.fence(), _train_on(live)))
    fenced.start()
    fenced.join(0.2)
    assert fenced.is_alive()  # the change waits behind the copy
    release.set()
    fenced.join(30)
    pending.wait()
    _assert_same(expected, copy)


def test_a_checkpoint_due_while_one_is_written_is_skipped_and_counted(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)  # the slow disk: the first write stays in flight
    order: list[str] = []

    async def main():
        w = CheckpointWriter(tmp_path)
        live = _live()
        assert await w.save(_state(1), lambda: live, b"1", lambda p: order.append(p.name)) \
            is not None
        await _until(gate.reached)
        t0 = time.monotonic()
        for step in (2, 3):  # due meanwhile: skipped at once, never waited for
            assert await w.save(_state(step), lambda: live, b"", order.append) is None
        # Never waited for the save held at its gate (it waits until the gate opens).
        assert time.monotonic() - t0 < 30 and w.skipped == 2 and order == []
        gate.open.set()
        await w.wait()
        assert await w.save(_state(4), lambda: live, b"4", lambda p: order.append(p.name)) \
            is not None
        await w.wait()
        assert order == ["step_1", "step_4"] and w.skipped == 2

    asyncio.run(main())
    assert latest_checkpoint(tmp_path).name == "step_4"


def test_a_failed_background_write_is_taken_once_and_durable_stays(tmp_path, monkeypatch):
    """An injected ENOSPC (a raising stand-in for the tensors write)."""
    done: list[Path] = []

    async def main():
        w = CheckpointWriter(tmp_path)
        await w.save(_state(1), _live, b"1", done.append)
        await w.wait()
        monkeypatch.setattr(ck, "save_file", lambda *a, **k: (_ for _ in ()).throw(
            OSError(28, "No space left on device")))
        await w.save(_state(2), _live, b"2", done.append)  # returns: the write is behind
        await w.wait()
        assert w.failures == 1
        e = w.take_error()
        assert isinstance(e, CheckpointError) and "step 2" in str(e) and "No space" in str(e)
        assert w.take_error() is None  # once
        monkeypatch.undo()
        await w.save(_state(3), _live, b"3", done.append)
        await w.wait()

    asyncio.run(main())
    assert [p.name for p in done] == ["step_1", "step_3"]
    assert latest_checkpoint(tmp_path).name == "step_3"
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def test_with_shards_the_save_is_synchronous(tmp_path):
    """DeepSpeed: the ranks write their partitions of the live engine before save returns."""
    calls: list[Path] = []

    async def main():
        w = CheckpointWriter(tmp_path)
        done: list[Path] = []
        await w.save(_state(1), _live, b"", done.append,
                     shards=lambda d: (calls.append(d), (d / "deepspeed").mkdir()))
        assert done == [tmp_path / "checkpoints" / "step_1"] and not w.busy
        assert (done[0] / "deepspeed").is_dir()

    asyncio.run(main())
    assert len(calls) == 1 and calls[0].name.startswith(".tmp_step_1")


def _fake_learner(tmp_path, live, on_error: str = "continue") -> SimpleNamespace:
    me = SimpleNamespace(
        state=LearnerState(step=3, version=2, received={"p0": 6}), counters={"x": 1.0},
        ledger=SimpleNamespace(prefixes=lambda: {"p0-a": 6}, to_dict=lambda: {"p0-a": [6]}),
        buffer=SimpleNamespace(snapshot=lambda: b"buffer"),
        trainer=SimpleNamespace(state=lambda: live, has_shards=False, save_shards=None),
        checkpoints=CheckpointWriter(tmp_path), control=SimpleNamespace(durable={"p0-a": 2}),
        cfg=SimpleNamespace(train=SimpleNamespace(on_checkpoint_error=on_error)),
        _owes_version=False)
    me._checkpoint_failed = lambda final=False: Learner._checkpoint_failed(me, final)
    return me


def test_learner_checkpoint_advances_durable_after_the_write(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    live = _live()
    me = _fake_learner(tmp_path, live)

    async def main():
        stall = await Learner.checkpoint(me)
        assert stall >= 0
        me.state.step = 4  # the next step begins at once
        me.state.received["p0"] = 8
        me.checkpoints.fence()  # as the next optimiser step does
        _train_on(live)
        await _until(gate.reached)
        assert me.control.durable == {"p0-a": 2}  # not yet: the write is held
        gate.open.set()
        await me.checkpoints.wait()
        assert me.control.durable == {"p0-a": 6}

    asyncio.run(main())
    state, tensors, buf = load_checkpoint(latest_checkpoint(tmp_path))
    assert state.step == 3 and state.received == {"p0": 6} and state.counters == {"x": 1.0}
    assert buf == b"buffer"
    _assert_same(_clone(_live()["scheduler"]), tensors["scheduler"])
    assert torch.equal(tensors["optimizer"]["state"][0]["exp_avg"], torch.ones(2))


def test_learner_final_checkpoint_waits_for_the_write(tmp_path):
    me = _fake_learner(tmp_path, _live())

    async def main():
        await Learner.checkpoint(me, final=True)
        assert not me.checkpoints.busy and me.control.durable == {"p0-a": 6}

    asyncio.run(main())
    assert latest_checkpoint(tmp_path).name == "step_3"


def test_learner_skips_while_writing_and_the_final_checkpoint_is_written(tmp_path, monkeypatch):
    """A slow disk (test double): checkpoints due during a write are skipped and counted, the
    producers keep their groups (durable stays at the write's), the final one is written."""
    gate = _Gate(monkeypatch)
    me = _fake_learner(tmp_path, _live())
    prefixes = {"p0-a": 6}
    me.ledger.prefixes = lambda: dict(prefixes)

    async def main():
        assert await Learner.checkpoint(me) is not None  # step 3: its write is held
        await _until(gate.reached)
        me.state.step, prefixes["p0-a"] = 4, 8
        assert await Learner.checkpoint(me) is None  # step 4: skipped
        assert me.checkpoints.skipped == 1 and me.control.durable == {"p0-a": 2}
        me.state.step, prefixes["p0-a"] = 5, 10
        final = asyncio.create_task(Learner.checkpoint(me, final=True))
        await asyncio.sleep(0.2)
        assert not final.done()  # the final one waits for the write in flight
        gate.open.set()
        await final
        assert me.control.durable == {"p0-a": 10}

    asyncio.run(main())
    assert latest_checkpoint(tmp_path).name == "step_5"
    assert load_checkpoint(latest_checkpoint(tmp_path))[0].step == 5


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_failed_write_is_one_line_and_training_goes_on_or_stops(tmp_path, monkeypatch, caplog,
                                                                   policy):
    """An injected ENOSPC (a raising stand-in for the tensors write) mid-run."""
    me = _fake_learner(tmp_path, _live(), on_error=policy)

    async def main():
        await Learner.checkpoint(me, final=True)  # step 3 written
        me.state.step = 4
        monkeypatch.setattr(ck, "save_file", lambda *a, **k: (_ for _ in ()).throw(
            OSError(28, "No space left on device")))
        await Learner.checkpoint(me)
        await me.checkpoints.wait()

    asyncio.run(main())
    caplog.set_level(logging.ERROR)
    if policy == "stop":
        with pytest.raises(CheckpointError, match="step 4"):
            Learner._checkpoint_failed(me)
    else:
        Learner._checkpoint_failed(me)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "No space left" in lines[0] and "step_3 is intact" in lines[0]
    assert f"on_checkpoint_error: {policy}" in lines[0]
    assert me.checkpoints.failures == 1 and latest_checkpoint(tmp_path).name == "step_3"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["LATEST", "step_3"]
    assert me.control.durable == {"p0-a": 6}  # producers keep what step 4 would have held


# A process that writes checkpoint 1, then checkpoint 2 in the background, and is killed with
# SIGKILL mid-write: while torch.save streams to a slow disk, or just before fsync and rename.
_WRITER = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    import torch
    from pipeline.learner import checkpoint as ck

    run_dir, where = Path(sys.argv[1]), sys.argv[2]
    big = {"model": {"w": torch.arange(4_000_000, dtype=torch.float32)}}

    def slow_disk(tensors, path):  # a slow disk (test double): part written, then stuck
        with open(path, "wb") as f:
            f.write(b"x" * (1 << 20))
            f.flush()
            time.sleep(600)

    async def main():
        w = ck.CheckpointWriter(run_dir)
        await w.save(ck.LearnerState(step=1), lambda: big, b"one", lambda p: None)
        await w.wait()
        if where == "tensors write":
            ck._save_file = slow_disk
        else:
            ck._fsync_tree = lambda top: time.sleep(600)
        big["model"]["w"].add_(1)
        await w.save(ck.LearnerState(step=2), lambda: big, b"two", lambda p: None)
        print("writing", flush=True)
        await w.wait()

    asyncio.run(main())
""")


@pytest.mark.parametrize("where", ["tensors write", "before the rename"])
def test_kill_9_during_the_background_write_keeps_the_previous_checkpoint(tmp_path, where):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), where], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    root = tmp_path / "checkpoints"
    try:
        assert proc.stdout.readline().strip() == "writing"
        tmp = root / f".tmp_step_2_{ck._HOST}_{proc.pid}"
        deadline = time.monotonic() + 60
        target = tmp / ("tensors-00000.safetensors" if where == "tensors write" else "state.json")
        while not (target.is_file() and target.stat().st_size > 0):
            assert time.monotonic() < deadline and proc.poll() is None, "never started writing"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
    assert tmp.is_dir() and not (root / "step_2").exists()  # killed mid-write
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt == root / "step_1"
    state, tensors, buf = load_checkpoint(ckpt)
    assert state.step == 1 and buf == b"one"
    assert torch.equal(tensors["model"]["w"], torch.arange(4_000_000, dtype=torch.float32))
    assert remove_partial(tmp_path) == [tmp]  # the next learner removes the dead write
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step_1"]


def test_remove_partial_leaves_a_live_write_alone(tmp_path):
    root = tmp_path / "checkpoints"
    mine = root / f".tmp_step_3_{ck._HOST}_{os.getpid()}"
    elsewhere = root / f".tmp_step_3_{ck._HOST}x_{2**22 + 1}"  # another host's write
    for d in (mine, elsewhere):
        d.mkdir(parents=True)
    assert remove_partial(tmp_path) == [] and mine.is_dir() and elsewhere.is_dir()


def test_a_save_cancelled_mid_copy_is_waited_for_before_the_next(tmp_path):
    """SIGTERM during a periodic checkpoint's copy: the final checkpoint must not fill the
    staging buffers while the cancelled copy's thread still writes them (a save meanwhile is
    skipped; ``wait`` holds until that thread is done)."""
    release, started = threading.Event(), threading.Event()
    live = _live()

    def slow_state():
        started.set()
        assert release.wait(30)
        return live

    async def main():
        w = CheckpointWriter(tmp_path)
        first = asyncio.create_task(w.save(_state(1), slow_state, b"", lambda p: None))
        await _until(started)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await w.save(_state(2), lambda: live, b"", lambda p: None) is None  # skipped
        waiting = asyncio.create_task(w.wait())  # what the final checkpoint does first
        await asyncio.sleep(0.2)
        assert not waiting.done()  # held behind the cancelled copy
        release.set()
        await waiting
        await w.save(_state(3), lambda: live, b"", lambda p: None)
        assert await w.wait() == tmp_path / "checkpoints" / "step_3"

    asyncio.run(main())
