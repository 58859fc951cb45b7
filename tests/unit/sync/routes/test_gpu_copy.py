"""The packed copies the GPU routes share (``sync.routes.gpu_copy.GpuCopies``) and the ipc
route's learner end (``sync.routes.ipc.IpcLearnerEnd``), the parts that need no GPU (buffers
and exports are faked; real ones: tests/e2e/test_gpu_transports.py, test_gpu_buckets.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sync.routes.gpu_copy import GpuCopies, PackedVersion, indexed_device
from sync.routes.ipc import IpcLearnerEnd


def _copies(keep: int = 2) -> GpuCopies:
    return GpuCopies("cpu", keep=keep, gpu_uuid="GPU-fake")


def _packed(version: int, on_gpu: bool = False) -> PackedVersion:
    flat = SimpleNamespace(is_cuda=True) if on_gpu else torch.zeros(4, dtype=torch.uint8)
    return PackedVersion(version, flat, [], [(0, 4)])  # type: ignore[arg-type]


@pytest.fixture
def no_cuda_calls(monkeypatch):
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)


def test_drop_host_versions_leaves_gpu_versions_and_counts_the_dropped(no_cuda_calls):
    """Before the final checkpoint the learner lets go of versions held in host memory (a
    sharded learner's); a version on the GPU (``is_cuda``, faked here) stays offered."""
    copies = _copies(keep=3)
    for p in (_packed(1), _packed(2, on_gpu=True), _packed(3)):
        copies.hold(p)
    assert copies.drop_host_versions() == 2
    assert copies.held() == [2]
    assert copies.drop_host_versions() == 0


def test_holds_the_newest_keep_and_offers_their_common_fields(no_cuda_calls):
    copies = _copies(keep=2)
    for v in (1, 2, 3):
        copies.hold(_packed(v))
    assert copies.held() == [2, 3] and copies.newest(5) == 3 and copies.newest(2) == 2
    assert copies.newest(1) is None and copies.payload(1) == {}
    assert copies.payload(3) == {"version": 3, "layout": [], "buckets": [[0, 4]]}


def test_ipc_end_offers_each_producer_its_own_export_of_held_versions_only(no_cuda_calls):
    copies = _copies(keep=2)
    end = IpcLearnerEnd(copies)
    for v in (1, 2, 3):  # as ``export`` leaves them (made up: no GPU here)
        end._exports[v] = {"p0": {"h": v}, "p1": {"h": -v}}
        copies.hold(_packed(v))
    assert end.offer(3, ["p0"]) == {"ipc": {"p0": {"h": 3}}}
    assert end.offer(3, ["p2"]) == {} and end.offer(9, ["p0"]) == {}
    # A SyncReady from a producer without bucket slots is not the ipc route's to answer.
    assert end.on_sync_ready("p0", "weights", 0, 3) is None
    end.close()
    assert end.offer(3, ["p0"]) == {}


def test_copies_device_gets_its_index_for_nccl_device_checks():
    # A single-process learner's device is a bare "cuda"; vLLM's PyNcclCommunicator compares
    # tensor.device (always cuda:N) with its own: it must be cuda:N too (found on 2 H200s).
    assert indexed_device("cuda", lambda: 1) == torch.device("cuda", 1)
    assert indexed_device(torch.device("cuda", 0), lambda: 1) == torch.device("cuda", 0)
    assert indexed_device("cpu", lambda: 1) == torch.device("cpu")
