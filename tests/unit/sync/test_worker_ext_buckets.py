"""The worker extension's bucketed load (``_sync_apply_buckets``, behind the bucketed ipc and
nccl routes) against a stand-in model (no vLLM): buckets load in turn and the commit makes the
version the rollback target; a torn bucket after others were loaded restores the previous
weights before the error returns, so the engine never serves a torn set."""

from __future__ import annotations

import pytest
import torch

from sync.packing import bucket_ranges, pack, plan_layout
from sync.slots import BucketError
from sync.snapshot import SnapshotError, SnapshotRef
from sync.worker_ext import WeightSyncExtension


class FakeWorker(WeightSyncExtension):
    def __init__(self, old: dict[str, torch.Tensor]):
        self.model = {k: v.clone() for k, v in old.items()}
        self.old = {k: v.clone() for k, v in old.items()}
        self.restored = 0

    def _sync_apply(self, tensors):
        for k, v in tensors.items():
            self.model[k].copy_(v)

    def _sync_restore_previous(self):
        self.restored += 1
        self._sync_apply(self.old)


def _setup():
    g = torch.Generator().manual_seed(2)
    new = {f"t{i}": torch.randn(40 + 30 * i, generator=g) for i in range(6)}
    old = {k: torch.zeros_like(v) for k, v in new.items()}
    layout = plan_layout(new)
    return old, new, layout, pack(new, layout, "cpu"), bucket_ranges(layout, 500)


def test_buckets_load_in_turn_and_commit_with_fake_worker():
    old, new, layout, flat, ranges = _setup()
    w = FakeWorker(old)
    ref = SnapshotRef(5, "/x/policy_v5.safetensors", "blake3:00")
    got = w._sync_apply_buckets(ref, layout, ranges, lambda on_bucket: [
        on_bucket(i, flat[s:e]) for i, (s, e) in enumerate(ranges)])
    assert got["buckets"] == len(ranges) > 2
    assert all(torch.equal(w.model[k], new[k]) for k in new)
    w.sync_apply_staged(5)  # the commit: nothing left to load, v5 becomes the rollback target
    assert w._sync_last_good == ref and w.restored == 0


def test_a_torn_bucket_restores_the_previous_weights_with_fake_worker():
    old, _new, layout, flat, ranges = _setup()
    w = FakeWorker(old)

    def receive(on_bucket):
        for i, (s, e) in enumerate(ranges):
            if i == 2:
                raise BucketError("v5 bucket 2: checksum mismatch (torn bucket); refused")
            on_bucket(i, flat[s:e])

    with pytest.raises(SnapshotError, match=r"torn bucket.*2 of \d+ buckets loaded, previous "
                                            r"weights restored"):
        w._sync_apply_buckets(SnapshotRef(5, "", ""), layout, ranges, receive)
    assert w.restored == 1 and all(torch.equal(w.model[k], old[k]) for k in old)
    with pytest.raises(SnapshotError, match="not staged"):
        w.sync_apply_staged(5)  # nothing to commit: the barrier resumes the engine on v4
