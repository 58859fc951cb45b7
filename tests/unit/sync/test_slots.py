"""sync.slots: a version handed over bucket by bucket through two slots and a shared control
block (two threads stand for the learner and the vLLM worker; CPU tensors stand for the GPU
slots). Every bucket arrives in order and whole; a torn or missing bucket is refused with its
index and the learner hears of it; a version no longer held is refused at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sync import slots as S
from sync.packing import (
    PackingError,
    bucket_layout,
    bucket_ranges,
    pack,
    plan_layout,
    ranges_from_wire,
    unpack,
)


def _version():
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(50 + 37 * i, generator=g) for i in range(7)}
    layout = plan_layout(tensors)
    return tensors, layout, pack(tensors, layout, "cpu")


def _handover(tmp_path, flat, ranges, *, version=3, serve_flat="same", on_fill=None,
              timeout=5.0):
    ctl_l = S.ControlBlock(tmp_path / "ctl", create=True)
    ctl_w = S.ControlBlock(tmp_path / "ctl")
    ctl_w[S.VERSION] = -1
    slots = [torch.zeros(max(e - s for s, e in ranges), dtype=torch.uint8) for _ in range(2)]
    got, errors = [], {}

    def learner():
        try:
            S.serve_buckets(ctl_l, version, flat if serve_flat == "same" else serve_flat,
                            ranges, slots, time.monotonic() + timeout)
        except Exception as e:
            errors["learner"] = e

    def on_bucket(i, buf):
        if on_fill is not None:
            on_fill(i, buf)
        got.append((i, buf.clone()))

    th = threading.Thread(target=learner)
    th.start()
    try:
        S.receive_buckets(ctl_w, version, ranges, slots, time.monotonic() + timeout, on_bucket)
    except Exception as e:
        errors["worker"] = e
    th.join(10)
    return got, errors, ctl_l


def test_every_bucket_arrives_in_order_and_whole(tmp_path):
    tensors, layout, flat = _version()
    ranges = bucket_ranges(layout, 600)
    assert len(ranges) >= 4  # more buckets than slots: each slot is reused
    got, errors, ctl = _handover(tmp_path, flat, ranges)
    assert errors == {}
    assert [i for i, _ in got] == list(range(len(ranges)))
    for i, buf in got:
        start, end = ranges[i]
        for name, t in unpack(buf, bucket_layout(layout, start, end)).items():
            assert torch.equal(t, tensors[name]), name
    assert ctl[S.DONE] == len(ranges) and ctl[S.STATE] == S.RUNNING


def test_a_torn_bucket_is_refused_and_the_learner_hears_of_it(tmp_path, monkeypatch):
    _t, layout, flat = _version()
    ranges = bucket_ranges(layout, 600)
    # The worker (this thread) finds bucket 2's bytes changed after the learner summed them:
    # it refuses the bucket before the loader sees it.
    orig, worker_calls = S.word_sum, []

    def torn_sum(buf):
        value = orig(buf)
        if threading.current_thread() is threading.main_thread():
            worker_calls.append(1)
            if len(worker_calls) == 3:
                return value + 1
        return value

    monkeypatch.setattr(S, "word_sum", torn_sum)
    got, errors, ctl = _handover(tmp_path, flat, ranges)
    assert "torn bucket" in str(errors["worker"]) and "bucket 2" in str(errors["worker"])
    assert [i for i, _ in got] == [0, 1]  # bucket 2 never reached the loader
    assert ctl[S.STATE] == S.WORKER_FAILED
    assert "worker gave up" in str(errors["learner"])


def test_a_missing_bucket_times_out_with_its_index(tmp_path):
    _t, layout, flat = _version()
    ranges = bucket_ranges(layout, 600)
    # The learner's manifest has one bucket less than the worker's: the last never arrives.
    ctl_l = S.ControlBlock(tmp_path / "ctl", create=True)
    ctl_w = S.ControlBlock(tmp_path / "ctl")
    slots = [torch.zeros(max(e - s for s, e in ranges), dtype=torch.uint8) for _ in range(2)]
    th = threading.Thread(target=S.serve_buckets, args=(ctl_l, 4, flat, ranges[:-1], slots,
                                                       time.monotonic() + 1.0))
    th.start()
    with pytest.raises(S.BucketError, match=f"bucket {len(ranges) - 1} of {len(ranges)} "
                                            "never arrived"):
        S.receive_buckets(ctl_w, 4, ranges, slots, time.monotonic() + 0.5, lambda i, b: None)
    th.join(5)


def test_a_version_no_longer_held_is_refused_at_once(tmp_path):
    _t, layout, flat = _version()
    ranges = bucket_ranges(layout, 600)
    t0 = time.monotonic()
    got, errors, _ctl = _handover(tmp_path, flat, ranges, serve_flat=None, timeout=120.0)
    assert got == [] and "no longer holds v3" in str(errors["worker"])
    assert time.monotonic() - t0 < 60  # refused, not left to the 120 s timeout


def test_bucket_ranges_cover_the_layout_at_tensor_boundaries_and_are_checked():
    _t, layout, _flat = _version()
    ranges = bucket_ranges(layout, 600)
    assert ranges_from_wire([list(r) for r in ranges], layout) == ranges
    assert bucket_ranges(layout, 1 << 30) == [(0, ranges[-1][1])]
    bad = [list(r) for r in ranges]
    bad[1][0] += 256  # a gap
    with pytest.raises(PackingError, match=r"buckets\[1\]"):
        ranges_from_wire(bad, layout)
    with pytest.raises(PackingError, match="cover"):
        ranges_from_wire([list(r) for r in ranges[:-1]], layout)


def test_an_announce_cannot_point_the_worker_at_another_file():
    assert S.control_path_ok(S.control_path("/dev/shm", 42, "p0"))
    for bad in ("/etc/passwd", "/dev/shm/other", "/dev/shm/pipeline-slots-1-../../etc/x",
                "/dev/shm/pipeline-slots-1-p0/x", None, 7):
        assert not S.control_path_ok(bad), bad


def test_word_sum_in_chunks_is_the_whole_sum(monkeypatch):
    rng = np.random.default_rng(0)
    for n in (0, 3, 4, 1001, 4096 * 4 + 7):
        buf = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
        words = buf[: n - n % 4].numpy().view(np.int32).astype(np.int64).sum()
        want = int(words) + int(buf[n - n % 4:].numpy().astype(np.int64).sum())
        monkeypatch.setattr(S, "SUM_CHUNK", 1000)  # several chunks and a partial one
        assert S.word_sum(buf) == want, n


def test_word_sum_does_not_copy_the_bucket_to_int64():
    """A reduction to int64 copies its int32 input first: summed whole, a 1 GiB bucket cost
    2 GiB more on the GPU every version. In chunks, the copy is 128 MiB."""
    code = ("import resource, torch; from sync.slots import word_sum; "
            "b = torch.ones(512 << 20, dtype=torch.uint8); r = resource.getrusage; "
            "before = r(resource.RUSAGE_SELF).ru_maxrss; word_sum(b); "
            "print((r(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[3])
    assert float(out.stdout) < 300, f"{out.stdout} MiB more at the peak (whole: 1024)"
