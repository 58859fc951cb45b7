"""Learner._capture packs the weights once and offers that buffer to the GPU publisher for the
live ipc/nccl producers (trainer, publisher and routes are fakes: the GPU path needs GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pipeline.learner.loop import Learner
from sync.packing import unpack


def _fake(routes, publisher):
    tensors = {"w": torch.ones(2), "b": torch.arange(3, dtype=torch.int64)}
    return SimpleNamespace(trainer=SimpleNamespace(snapshot_tensors=lambda: tensors),
                           publisher=publisher, _gpu_routes=lambda: routes, counters={})


def test_capture_packs_a_copy_and_offers_it_to_the_ipc_producers_fake_publisher():
    calls = []
    pub = SimpleNamespace(publish_packed=lambda v, flat, layout, ipc: calls.append(
        (v, flat, sorted(ipc))))
    me = _fake({"p0": "ipc", "p1": "nccl", "p2": "ipc"}, pub)
    flat, layout = Learner._capture(me, 7)
    assert [(v, ipc) for v, _f, ipc in calls] == [(7, ["p0", "p2"])]
    assert calls[0][1] is flat  # the same buffer: one copy serves the GPU routes and the file
    views = unpack(flat, layout)
    assert torch.equal(views["w"], torch.ones(2)) and torch.equal(views["b"], torch.arange(3))
    me.trainer.snapshot_tensors()["w"].add_(5)  # training goes on: the capture is a copy
    assert torch.equal(views["w"], torch.ones(2))


def test_capture_without_gpu_routes_offers_nothing_fake_publisher():
    calls = []
    me = _fake({}, SimpleNamespace(publish_packed=lambda *a, **k: calls.append(a)))
    _flat, layout = Learner._capture(me, 1)
    assert calls == [] and [e.name for e in layout] == ["w", "b"]


def test_a_failed_gpu_offer_leaves_the_file_route_fake_publisher():
    def broken(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    me = _fake({"p0": "ipc"}, SimpleNamespace(publish_packed=broken))
    flat, _layout = Learner._capture(me, 3)
    assert me.counters["gpu_publish_failures"] == 1 and flat.numel() > 0
