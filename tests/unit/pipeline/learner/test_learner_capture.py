"""Learner._capture_snapshot hands the GPU publisher one IPC export per live ipc producer (the
trainer, publisher and routes are fakes: this path needs GPUs, so CPU runs never reach it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pipeline.learner.loop import Learner


def test_capture_publishes_for_the_ipc_producers_fake_publisher():
    calls = []
    fake = SimpleNamespace(
        trainer=SimpleNamespace(snapshot_tensors=lambda: {"w": torch.ones(2)}),
        publisher=SimpleNamespace(publish=lambda v, t, ipc: calls.append((v, sorted(ipc)))),
        _gpu_routes=lambda: {"p0": "ipc", "p1": "nccl", "p2": "ipc"})
    cpu = Learner._capture_snapshot(fake, 7)
    assert calls == [(7, ["p0", "p2"])]
    assert torch.equal(cpu["w"], torch.ones(2))


def test_capture_without_gpu_routes_publishes_nothing_fake_publisher():
    calls = []
    fake = SimpleNamespace(
        trainer=SimpleNamespace(snapshot_tensors=lambda: {"w": torch.ones(2)}),
        publisher=SimpleNamespace(publish=lambda *a, **k: calls.append(a)),
        _gpu_routes=lambda: {})
    Learner._capture_snapshot(fake, 1)
    assert calls == []
