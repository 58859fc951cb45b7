"""Weights from a sharded learner bucket by bucket over the GPU routes (skipped on CPU machines;
run them on the device tool, CONTRIBUTING "GPU tests").

- 1 GPU: a version held in host memory (as a ZeRO-3 learner holds it) handed by the ipc route's
  learner end (``IpcLearnerEnd``) through two CUDA IPC bucket slots to a worker extension in another
  process (``sync_ipc_stage`` + ``sync_ipc_receive``), bucket by bucket, equal to the packed
  weights; a version no longer held is refused at once.
- 2 GPUs, the product (issue 27's colocated layout): `pipeline-train` with a producer on each GPU
  and a ZeRO-3 learner over both, small buckets: producer 0 (rank 0's GPU) takes every version
  by ipc slots, producer 1 by nccl buckets, with no GPU publish failure, no file fallback and no
  failed sync.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.support.launcher import read_metrics


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(_gpus() < 1, reason="needs a GPU")]

REPO = Path(__file__).resolve().parents[2]


def _worker(conn, version: int, fields: dict, layout_wire: list, out: str) -> None:
    """Child process: a worker extension without vLLM (the model is a dict of GPU tensors)."""
    sys.path.insert(0, str(REPO))
    import torch

    from sync.packing import layout_from_wire
    from sync.worker_ext import WeightSyncExtension

    class Worker(WeightSyncExtension):
        device = torch.device("cuda", 0)

        def _sync_checked_layout(self, version, layout_wire):
            return layout_from_wire(layout_wire)

        def _sync_apply(self, tensors):
            for k, v in tensors.items():
                self.model[k] = v.clone()

        def _sync_restore_previous(self):
            self.model.clear()

    w = Worker()
    w.model = {}
    try:
        w.sync_ipc_stage(version, fields, layout_wire, "", "")
        conn.send("staged")
        conn.recv()  # the learner is about to serve
        got = w.sync_ipc_receive(version, 30.0)
        w.sync_apply_staged(version)
        torch.save({"got": got, "model": {k: v.cpu() for k, v in w.model.items()}}, out)
        refused = ""
        w.sync_ipc_stage(version + 1, fields, layout_wire, "", "")
        conn.send("staged")
        conn.recv()
        try:
            w.sync_ipc_receive(version + 1, 10.0)
        except Exception as e:
            refused = str(e)
        conn.send(refused)
    except Exception as e:
        conn.send(f"error: {e!r}")


def test_ipc_slots_hand_a_host_version_to_another_process(tmp_path):
    import torch

    from sync.packing import layout_to_wire, pack, plan_layout, unpack
    from sync.routes.gpu_copy import GpuCopies
    from sync.routes.ipc import IpcLearnerEnd

    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.w": torch.randn(1024, 257 + i, generator=g).to(torch.bfloat16)
               for i in range(12)}
    layout = plan_layout(tensors)
    flat = pack(tensors, layout, "cpu").pin_memory()  # host-held, as a ZeRO-3 capture
    copies = GpuCopies("cuda:0", bucket_bytes=1 << 20)  # ~0.5 MB tensors: many buckets
    ipc = IpcLearnerEnd(copies)
    packed = copies.prepare(7, flat, layout)
    ipc.export(packed, ["p0"])
    copies.hold(packed)
    payload = copies.payload(7) | ipc.offer(7, ["p0"])
    assert len(payload["buckets"]) > 4 and "slots" in payload["ipc"]["p0"]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, 7, payload["ipc"]["p0"],
                                             layout_to_wire(layout), str(tmp_path / "w.pt")))
    proc.start()
    try:
        assert parent.poll(120) and parent.recv() == "staged"
        parent.send("go")
        assert asyncio.run(ipc.send("p0", 7)) == "send"
        assert parent.poll(120) and parent.recv() == "staged"
        parent.send("go")
        assert asyncio.run(ipc.send("p0", 8)) == "refuse"  # v8 is not held
        assert parent.poll(60)
        refused = parent.recv()
        assert "no longer holds v8" in refused, refused
    finally:
        proc.join(60)
        ipc.close()
        copies.close()
    res = torch.load(tmp_path / "w.pt")
    assert res["got"]["buckets"] == len(payload["buckets"])
    want = unpack(flat, layout)
    assert set(res["model"]) == set(want)
    for k, v in want.items():
        assert torch.equal(res["model"][k], v), k


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed")
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_pipeline_train_colocated_zero3_two_gpus_weights_by_gpu_buckets(tmp_path):
    from conftest import assert_no_process_left

    model = tmp_path / "qwen2-0.5b-random"
    subprocess.run([sys.executable, "-m", "bench.gpu_model", str(model), "--size", "0.5b"],
                   cwd=REPO, check=True, timeout=600)
    run_dir = tmp_path / "run"
    tag = f"gpubuckets{os.getpid()}"
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(model),
           "--data", "arithmetic:200", "--reward", "pipeline.tasks.rewards:length_reward",
           "--num-producers", "2", "--producer_gpus", '["0","1"]', "--learner_gpus", "0,1",
           "--batch-groups", "4", "--group-size", "4", "--max-tokens", "32",
           "--run-dir", str(run_dir), "--mode", "async", "--max-staleness", "1",
           "--steps", "5", "--engine.max_model_len", "512",
           "--engine.gpu_memory_utilization", "0.25", "--tensorboard", "false",
           "--train.learner_processes", "2", "--sync.bucket_mb", "64",
           "--train.accelerate_config", str(REPO / "examples" / "accelerate" / "zero3.yaml")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PIPELINE_TEST_RUN=tag))
    (tmp_path / "train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_no_process_left(tag)
    rows = read_metrics(run_dir)
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["version"] >= 3
    for r in rows:
        for key in ("gpu_publish_failures", "transport_fallbacks", "sync_failures"):
            assert r.get(key, 0) == 0, (r["step"], key, r.get(key))
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "weights by ipc" in logs and "weights by nccl" in logs
