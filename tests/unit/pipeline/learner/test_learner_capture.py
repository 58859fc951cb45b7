"""LearnerRoutes.capture packs the weights once, bucket by bucket, and publishes that buffer to the
learner ends of the live ipc/nccl producers' routes (trainer, GPU copies, learner ends and routes
are fakes: the GPU path needs GPUs); ``capture_device`` says where that buffer lives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.learner.routes import LearnerRoutes, capture_device
from sync.packing import PackingError, ipc_export, plan_buckets, plan_layout, unpack


def _fake(routes, copies, ends=None, lora=False, bucket_mb=1):
    tensors = {"w": torch.ones(2), "b": torch.arange(3, dtype=torch.int64)}
    asked = []

    def buckets(nbytes):
        asked.append(nbytes)
        yield {"w": tensors["w"]}
        yield {"b": tensors["b"]}

    trainer = SimpleNamespace(
        snapshot_tensors=lambda: tensors, snapshot_buckets=buckets,
        snapshot_plan=lambda: None if lora else {k: (v.dtype, tuple(v.shape))
                                                 for k, v in tensors.items()},
        device=torch.device("cpu"), zero_stage=0, sharded=False, tensors=tensors, asked=asked)
    me = SimpleNamespace(trainer=trainer, copies=copies, ends=ends or {},
                         live_gpu_routes=lambda: routes, counters={},
                         cfg=SimpleNamespace(sync=SimpleNamespace(bucket_mb=bucket_mb,
                                                                  host_copies=None)))
    me.count_failure = lambda v, e: LearnerRoutes.count_failure(me, v, e)
    me.publish = lambda *a: LearnerRoutes.publish(me, *a)
    return me


def _copies(calls):
    """Records prepare and hold; the packed version is (version, flat)."""
    return SimpleNamespace(device=torch.device("cpu"),
                           prepare=lambda v, flat, layout: (v, flat),
                           hold=lambda packed: calls.append(("hold", packed[0])))


def _end(name, calls):
    return SimpleNamespace(name=name, export=lambda packed, producers: calls.append(
        (name, packed[0], packed[1], sorted(producers))))


@pytest.mark.parametrize("lora", [False, True])
def test_capture_packs_a_copy_and_each_end_exports_it_before_it_is_held_fakes(lora):
    calls = []
    ends = {"ipc": _end("ipc", calls), "nccl": _end("nccl", calls)}
    me = _fake({"p0": "ipc", "p1": "nccl", "p2": "ipc"}, _copies(calls), ends, lora=lora)
    flat, layout = LearnerRoutes.capture(me, 7)
    assert [c if c[0] == "hold" else (c[0], c[1], c[3]) for c in calls] == [
        ("ipc", 7, ["p0", "p2"]), ("nccl", 7, ["p1"]), ("hold", 7)]
    assert calls[0][2] is flat  # the same buffer: one copy serves the GPU routes and the file
    views = unpack(flat, layout)
    assert torch.equal(views["w"], torch.ones(2)) and torch.equal(views["b"], torch.arange(3))
    me.trainer.tensors["w"].add_(5)  # training goes on: the capture is a copy
    assert torch.equal(views["w"], torch.ones(2))
    # Buckets of sync.bucket_mb, unless LoRA (computed from the whole state).
    assert me.trainer.asked == ([] if lora else [1 << 20])


def test_capture_without_gpu_routes_offers_nothing_fakes():
    calls = []
    me = _fake({}, _copies(calls), {"ipc": _end("ipc", calls)})
    _flat, layout = LearnerRoutes.capture(me, 1)
    assert calls == [] and [e.name for e in layout] == ["w", "b"]


def test_a_failed_gpu_offer_leaves_the_file_route_fakes():
    def broken(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    calls = []
    me = _fake({"p0": "ipc"}, _copies(calls), {"ipc": SimpleNamespace(export=broken)})
    flat, _layout = LearnerRoutes.capture(me, 3)
    assert me.counters["gpu_publish_failures"] == 1 and flat.numel() > 0
    assert calls == []  # never held: no announce offers it


def test_ipc_export_refuses_a_host_buffer_and_says_where_it_is():
    """The 7B/ZeRO-3 failure: the buffer was packed next to a state dict that DeepSpeed had
    gathered onto the CPU; the export now names the device instead of a vague condition."""
    tensors = {"w": torch.ones(4)}
    layout = plan_layout(tensors)
    flat = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(PackingError, match="needs a CUDA buffer; this one is on cpu"):
        ipc_export(flat, "GPU-x")
    assert layout[0].nbytes == 16


def test_capture_device_puts_gpu_routes_on_the_copies_gpu_whatever_the_state():
    cuda0, cpu = torch.device("cuda", 0), torch.device("cpu")
    # The root cause: the buffer went where the state dict's tensors were (a ZeRO-3 learner's
    # are gathered onto the CPU); a whole GPU copy now goes to the GPU copies' device.
    assert capture_device(cpu, "cuda:1", gpu_routes=True, sharded=False) == torch.device(
        "cuda", 1)
    # Sharded: host memory even for GPU routes (they take it bucket by bucket from there).
    assert capture_device(cuda0, cuda0, gpu_routes=True, sharded=True) == cpu
    # Single GPU, file only: device-local copy as before (the writer copies it off the path).
    assert capture_device(cuda0, cuda0, gpu_routes=False, sharded=False) == cuda0
    # Sharded, file only: host memory, never a second whole model on a GPU.
    assert capture_device(cuda0, cuda0, gpu_routes=False, sharded=True) == cpu
    assert capture_device(cpu, None, gpu_routes=False, sharded=False) == cpu


def test_plan_buckets_cuts_in_order_within_the_budget():
    tensors = {"a": torch.zeros(100), "b": torch.zeros(100), "c": torch.zeros(1000),
               "d": torch.zeros(10)}  # 400, 400, 4000, 40 bytes
    layout = plan_layout(tensors)
    assert plan_buckets(layout, 800) == [["a", "b"], ["c"], ["d"]]
    assert plan_buckets(layout, 1 << 20) == [["a", "b", "c", "d"]]
    assert plan_buckets(layout, 1) == [["a"], ["b"], ["c"], ["d"]]


def test_device_capture_bytes_only_for_a_buffer_on_a_gpu_fake_trainer():
    """The writer's pinned buffer is allocated before training only when versions are packed
    on a GPU: the size of the packed layout, else 0 (CPU learner, LoRA, sharded)."""
    from sync.packing import plan_layout_of, total_bytes

    me = _fake({}, None)
    assert LearnerRoutes.device_capture_bytes(me) == 0  # a CPU learner
    me.trainer.device = torch.device("cuda", 0)  # only read, never used: no GPU needed
    want = total_bytes(plan_layout_of(me.trainer.snapshot_plan()))
    assert want > 0 and LearnerRoutes.device_capture_bytes(me) == want
    me.cfg.sync.host_copies = True  # the memory plan keeps versions in host memory
    assert LearnerRoutes.device_capture_bytes(me) == 0
    me.cfg.sync.host_copies = None
    me.trainer.sharded = True  # a sharded learner packs in host memory
    assert LearnerRoutes.device_capture_bytes(me) == 0
    assert LearnerRoutes.device_capture_bytes(_fake({}, None, lora=True)) == 0
