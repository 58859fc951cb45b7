"""EngineWeights, the one load path of the producer, the dedicated evaluator and checkpoint
evaluation: which route a version takes, what each role's constructor arguments change, and a
failed load leaving the engine resumed on its version. The engine is a mock that records its
worker RPCs and pauses (named so); real barrier, real routes."""

from __future__ import annotations

import asyncio

from pipeline.config import load_config
from pipeline.producer.weights import EngineWeights, weight_routes
from sync.snapshot import SnapshotRef
from tests.unit.sync.engine_fakes import MockEngine

REF = SnapshotRef(1, "/snap/policy_v1.safetensors", "blake2b:x")


async def _no_link(purpose: str, epoch: int, version: int) -> None:
    raise AssertionError("no link is set up in these tests")


def _load(weights: EngineWeights, ref: SnapshotRef, route: str = "file",
          transfer: dict | None = None):
    return asyncio.run(asyncio.wait_for(weights.load(ref, route, transfer), 10))


def test_files_only_weights_load_each_version_from_its_file_fake_engine(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    engine = MockEngine()
    weights = EngineWeights(engine, cfg, "evaluator", weight_routes(engine, cfg, "evaluator"))
    assert set(weights.routes) == {"file"}  # no send_ready: no GPU route
    report = _load(weights, REF)
    assert report.ok and weights.version == 1 and weights.barrier.swaps == 1
    # Staged while the engine serves, applied inside the pause.
    assert engine.calls == [("sync_stage_snapshot", False), ("sync_apply_staged", True)]
    assert not engine.paused
    # A GPU copy announced before its file: nothing this engine can load yet.
    assert _load(weights, SnapshotRef(2, "", ""), "ipc", {"version": 2}) is None
    assert weights.version == 1


def test_a_gpu_route_without_a_usable_copy_falls_back_to_the_file_fake_engine(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    engine = MockEngine()
    weights = EngineWeights(engine, cfg, "p0", weight_routes(engine, cfg, "p0", _no_link))
    assert set(weights.routes) == {"file", "ipc", "nccl"}
    # The learner offers v1's copy by ipc, but not to us (no handle of ours): the file.
    report = _load(weights, REF, "ipc", {"version": 1, "layout": []})
    assert report.ok and weights.version == 1
    assert [m for m, _ in engine.calls] == ["sync_stage_snapshot", "sync_apply_staged"]
    # Only the GPU copy, and not of this version: wait for the file.
    assert _load(weights, SnapshotRef(2, "", ""), "ipc", {"version": 3}) is None


def test_a_failed_load_keeps_the_version_and_resumes_the_engine_fake_engine(tmp_path):
    cfg = load_config(overrides={"run_dir": str(tmp_path)})
    engine = MockEngine(fail=frozenset({"sync_apply_staged"}))
    weights = EngineWeights(engine, cfg, "p0", weight_routes(engine, cfg, "p0"))
    report = _load(weights, REF)
    assert not report.ok and report.version == 0 and weights.version == 0
    assert weights.barrier.failures == 1 and not engine.paused


def test_checkpoint_weights_are_full_weights_under_barrier_keep_whatever_the_plan(tmp_path):
    """The run's plan serves LoRA adapters; a checkpoint's snapshot holds every weight (LoRA
    merged), so its weights serve no adapter, and load with the barrier's mode "keep"."""
    cfg = load_config(overrides={"run_dir": str(tmp_path), "train.lora_rank": 8,
                                 "sync.lora_adapters": "on"})
    engine = MockEngine()
    run = EngineWeights(engine, cfg, "p0", weight_routes(engine, cfg, "p0"))
    assert run.serving == "lora" and run.adapters is not None
    assert run.barrier.mode == cfg.sync.barrier == "drain_prefill"
    ckpt = EngineWeights(engine, cfg, "eval", weight_routes(engine, cfg, "eval"),
                         barrier_mode="keep", serving="")
    assert ckpt.serving == "" and ckpt.adapters is None and ckpt.lora_request(1) is None
    assert ckpt.barrier.mode == "keep"
    report = _load(ckpt, REF)
    assert report.ok and ckpt.version == 1
