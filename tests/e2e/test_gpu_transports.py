"""The GPU weight routes on real vLLM (0.25.1 on the device tool), checked by effect.

This test process plays the learner (the routes' learner ends, ``sync.routes.ipc.IpcLearnerEnd``
and ``sync.routes.nccl.NcclLearnerEnd``, over ``sync.routes.gpu_copy.GpuCopies``); the engine's
worker runs in vLLM's engine-core process, so CUDA IPC and NCCL really cross processes:
- ``ipc``: the learner's copies and the engine on GPU 0 (one GPU is enough);
- ``nccl``: the learner's copies on GPU 1, the engine on GPU 0 (skipped with fewer than 2 GPUs).
Each swap runs under load (requests in flight, none may be lost or cut short), then greedy
tokens for a fixed prompt must equal a fresh engine's on the new weights, and swapping back must
restore the original tokens. Failure paths: a learner that never answers (the receive times out,
the link is aborted, the version loads from the file) and a version the learner no longer holds
(refused, file, link kept). Then the product: `pipeline-train` in the split layout (producer on
GPU 0, learner on GPU 1) with ``sync.route=auto`` picks ``nccl`` and trains without a fallback.
SyncReady messages go through the real wire format (buffer.protocol), as on the wire.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import assert_no_children, assert_no_process_left

from bench.sync_bench import generate, model_tensors, perturbed, random_prompt
from buffer.protocol import SyncReady, decode, encode
from sync.barrier import RequestTracker, SwapBarrier
from sync.routes import plan_route
from sync.routes.base import swap_with_fallback
from sync.routes.file import FileRoute
from sync.routes.ipc import IpcRoute
from sync.routes.nccl import NcclRoute, nccl_offer
from sync.snapshot import SnapshotRef, write_snapshot
from tests.e2e.support.engine_loop import VOCAB, EngineLoop, hf_dir_with, probe
from tests.e2e.support.launcher import read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PID = "p0"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def weights(tiny_model, tmp_path_factory):
    """Base and perturbed weights, a HF dir of the perturbed ones (for a fresh engine), and a
    directory for the file snapshots (each version's rollback target and fallback)."""
    d = tmp_path_factory.mktemp("gpu-transports")
    base = model_tensors(tiny_model)
    new = perturbed(base, scale=0.5, seed=1)
    hf_new = hf_dir_with(tiny_model, new, d / "hf-perturbed")
    return {"base": base, "new": new, "dir": d, "hf_new": hf_new}


@pytest.fixture(scope="module")
def fresh_probe(weights):
    """Greedy tokens of a freshly started engine on the new weights (then shut down)."""
    loop = EngineLoop(weights["hf_new"])
    try:
        return loop.run(probe(loop.engine, RequestTracker()))[0]
    finally:
        loop.close()


@pytest.fixture(scope="module")
def eng(tiny_model, fresh_probe):
    e = EngineLoop(tiny_model)
    e.tracker = RequestTracker()
    e.base_probe = e.run(probe(e.engine, e.tracker))[0]
    assert e.base_probe != fresh_probe, "the perturbation does not change greedy output"
    yield e
    e.close()
    assert_no_children()


class Learner:
    """The learner's side of one test: the packed copies, the learner end of each GPU route, and
    the SyncReady dispatch of pipeline's learner (to the end of the producer's route, here
    ``route``), with the message going through the wire format."""

    def __init__(self, device: str, timeout_s: float = 30.0, answer: bool = True,
                 route: str = "nccl"):
        from sync.routes import learner_ends
        from sync.routes.gpu_copy import GpuCopies

        self.copies = GpuCopies(device)
        self.ends = learner_ends(self.copies, timeout_s=timeout_s)
        self.ipc, self.nccl = self.ends["ipc"], self.ends["nccl"]
        self.answer, self.route = answer, route
        self.tasks: list[asyncio.Task] = []

    async def send_ready(self, purpose: str, epoch: int, version: int) -> None:
        _, msg = decode(encode(SyncReady(producer_id=PID, incarnation=f"{PID}-1",
                                         purpose=purpose, epoch=epoch, version=version)))
        if not self.answer:
            return  # a learner that is dead or late
        coro = self.ends[self.route].on_sync_ready(PID, msg.purpose, msg.epoch, msg.version)
        if coro is not None:  # a "drop" is done at once: our end dropped, offered anew later
            self.tasks.append(asyncio.get_running_loop().create_task(coro))

    def publish(self, version: int, tensors: dict, route: str) -> dict:
        """Hold ``tensors`` as ``version`` for PID on ``route``: the Announce's transfer."""
        packed = self.copies.pack(version, tensors)
        self.ends[route].export(packed, [PID])
        self.copies.hold(packed)
        return self.copies.payload(version) | self.ends[route].offer(version, [PID])

    def close(self) -> None:
        for end in self.ends.values():
            end.close()
        self.copies.close()


async def _swap_under_load(e: EngineLoop, route: str, ref: SnapshotRef, transfer: dict,
                           nccl: NcclRoute | None = None, n: int = 32):
    """n requests in flight, then one swap through ``route`` (file fallback as in producer)."""
    tk = e.tracker
    rng = random.Random(ref.version)
    tasks = [asyncio.create_task(generate(e.engine, tk, f"{route}-{ref.version}-{i}",
                                          random_prompt(rng, rng.randint(100, 400), VOCAB),
                                          max_tokens=48)) for i in range(n)]
    while sum(tk.in_flight.values()) < 2:
        await asyncio.sleep(0.01)
    barrier = SwapBarrier(e.engine, tk, drain_timeout_s=120, pause_timeout_s=120,
                          load_timeout_s=120)
    file = FileRoute(e.engine)
    if route == "ipc":
        ipc = IpcRoute(e.engine, PID)
        report = await swap_with_fallback(barrier, "ipc", ref, file,
                                          load=partial(ipc.apply, ref.version),
                                          prepare=partial(ipc.stage, ref, transfer))
    else:
        assert nccl is not None
        report = await swap_with_fallback(barrier, "nccl", ref, file,
                                          load=partial(nccl.receive_and_apply, ref, transfer))
    gens = await asyncio.gather(*tasks)
    for g in gens:
        assert g.finish_reason == "length" and len(g.tokens) == 48, "a request was cut short"
        assert g.versions == sorted(g.versions)
    return report


def _publish(learner: Learner, weights: dict, which: str, version: int, route: str):
    tensors = {k: v.to(learner.copies.device) for k, v in weights[which].items()}
    transfer = learner.publish(version, tensors, route)
    ref = write_snapshot(weights[which], version, weights["dir"])
    return ref, transfer


def test_ipc_swap_under_load_matches_fresh_engine(eng, weights, fresh_probe):
    learner = Learner("cuda:0", route="ipc")
    devices = eng.run(eng.engine.collective_rpc("sync_device_info"))
    my_gpus = [d["gpu_uuid"] for d in devices]
    assert my_gpus == [learner.copies.gpu_uuid], "the engine is not on the learner's GPU"
    for which, want in (("new", fresh_probe), ("base", eng.base_probe)):
        v = eng.next_version()
        ref, transfer = _publish(learner, weights, which, v, "ipc")
        assert plan_route("ipc", transfer, PID, my_gpus, None) == ("ipc", "")
        report = eng.run(_swap_under_load(eng, "ipc", ref, transfer), timeout=600)
        assert report.ok and "fallback" not in report.timings, report.error
        assert eng.run(probe(eng.engine, eng.tracker))[0] == want, f"ipc swap to {which}"
        print(f"\nipc v{v}: idle {report.timings['idle_s']:.3f}s load "
              f"{report.timings['load_s']:.3f}s prepare {report.timings['prepare_s']:.3f}s")
    learner.close()


@pytest.mark.skipif(_gpus() < 2, reason="nccl needs 2 GPUs (learner on GPU 1, engine on GPU 0)")
def test_nccl_swap_under_load_matches_fresh_engine_and_survives_faults(eng, weights,
                                                                      fresh_probe):
    learner = Learner("cuda:1", timeout_s=20.0)

    async def link_up(nccl: NcclRoute) -> dict:
        learner.nccl.maintain({PID: (True, 2)})  # offer a link, as the learner's announce loop
        offer = nccl_offer(learner.nccl.offer(0, [PID]), PID)
        assert offer is not None
        await nccl.join(offer)
        await asyncio.gather(*learner.tasks)
        assert learner.nccl.links[PID].state == "ready"
        return offer

    nccl = NcclRoute(eng.engine, learner.send_ready, timeout_s=20.0)
    eng.run(link_up(nccl), timeout=120)

    # 1. Swap to the new weights and back, under load, by effect.
    for which, want in (("new", fresh_probe), ("base", eng.base_probe)):
        v = eng.next_version()
        ref, transfer = _publish(learner, weights, which, v, "nccl")
        assert plan_route("nccl", transfer, PID, ["x"], nccl.joined) == ("nccl", "")
        report = eng.run(_swap_under_load(eng, "nccl", ref, transfer, nccl), timeout=600)
        assert report.ok and "fallback" not in report.timings, report.error
        assert eng.run(probe(eng.engine, eng.tracker))[0] == want, f"nccl swap to {which}"
        print(f"\nnccl v{v}: idle {report.timings['idle_s']:.3f}s load "
              f"{report.timings['load_s']:.3f}s")

    # 2. A version the learner no longer holds: refused, loaded from the file, link kept.
    v = eng.next_version()
    old_ref = write_snapshot(weights["new"], v, weights["dir"])
    _ref, transfer = _publish(learner, weights, "base", v + 100, "nccl")  # holds v+100 only
    learner.publish(v + 101, {k: t.to("cuda:1") for k, t in weights["base"].items()}, "nccl")
    report = eng.run(_swap_under_load(eng, "nccl", old_ref, transfer, nccl), timeout=600)
    assert report.ok and report.timings.get("fallback") == 1.0, report.error
    assert "no longer holds" in report.error and nccl.link is not None
    assert eng.run(probe(eng.engine, eng.tracker))[0] == fresh_probe

    # 3. A learner that never answers: the receive times out inside the pause, the link is
    #    aborted, the version comes from the file; a new link then works again.
    learner.answer = False
    nccl.timeout_s = 3.0
    v = eng.next_version()
    ref, transfer = _publish(learner, weights, "base", v, "nccl")
    report = eng.run(_swap_under_load(eng, "nccl", ref, transfer, nccl), timeout=600)
    assert report.ok and report.timings.get("fallback") == 1.0, report.error
    assert nccl.link is None, "the timed-out link was not dropped"
    assert eng.run(probe(eng.engine, eng.tracker))[0] == eng.base_probe
    learner.answer, nccl.timeout_s = True, 20.0
    learner.nccl.forget(PID)  # like a learner that saw the failure: a new epoch
    eng.run(link_up(nccl), timeout=120)
    v = eng.next_version()
    ref, transfer = _publish(learner, weights, "new", v, "nccl")
    report = eng.run(_swap_under_load(eng, "nccl", ref, transfer, nccl), timeout=600)
    assert report.ok and "fallback" not in report.timings, report.error
    assert eng.run(probe(eng.engine, eng.tracker))[0] == fresh_probe
    learner.close()


@pytest.mark.skipif(_gpus() < 2, reason="the split layout needs 2 GPUs")
def test_pipeline_train_split_layout_routes_weights_by_nccl(tiny_model, tmp_path):
    run_dir, tag = tmp_path / "run", f"gpusplit{os.getpid()}"
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(tiny_model),
           "--data", "arithmetic:200", "--reward", "pipeline.tasks.rewards:length_reward",
           "--num-producers", "1", "--batch-groups", "4", "--group-size", "4",
           "--max-tokens", "32", "--run-dir", str(run_dir), "--mode", "async",
           "--max-staleness", "1", "--steps", "6", "--engine.gpu_memory_utilization", "0.3",
           "--producer_gpus", '["0"]', "--learner_gpus", "1", "--sync.route", "auto",
           "--tensorboard", "false", "--verbose"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PIPELINE_TEST_RUN=tag))
    (tmp_path / "train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "weights by nccl" in proc.stderr, "auto did not route the split layout over NCCL"
    rows = read_metrics(run_dir)
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["version"] >= 4  # the producer followed the learner's versions
    assert all(r.get("transport_fallbacks", 0) == 0 and r.get("sync_failures", 0) == 0
               for r in rows), "a swap fell back to the file"
    assert_no_process_left(tag)


@pytest.mark.xfail(reason="engine.sleep_when_idle with the ipc route: after the engine's second "
                   "sleep (vLLM 0.25.1 cumem, weights discarded), load_weights of v3 fails "
                   "with 'CUDA error: invalid argument' and the swap falls back to the file "
                   "(H200; the same on the tree before the route restructure)", strict=False)
def test_pipeline_train_colocated_sync_by_ipc_with_the_engine_asleep_between_steps(
        tiny_model, tmp_path):
    """One GPU, sync mode, weights by CUDA IPC announced before their files, and
    engine.sleep_when_idle: every step trains on its own version, no swap falls back to the
    file, and the engine slept while the learner trained."""
    run_dir, tag = tmp_path / "run", f"gpusleep{os.getpid()}"
    cmd = [sys.executable, "-m", "pipeline.launch.cli", "--model", str(tiny_model),
           "--data", "arithmetic:200", "--reward", "pipeline.tasks.rewards:length_reward",
           "--num-producers", "1", "--batch-groups", "4", "--group-size", "4",
           "--max-tokens", "32", "--run-dir", str(run_dir), "--mode", "sync", "--steps", "5",
           "--engine.gpu_memory_utilization", "0.3", "--producer_gpus", '["0"]',
           "--learner_gpus", "0", "--sync.route", "ipc", "--engine.sleep_when_idle", "true",
           "--tensorboard", "false"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PIPELINE_TEST_RUN=tag))
    (tmp_path / "train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    logs = proc.stderr + "".join(p.read_text(errors="replace")
                                 for p in (run_dir / "logs").glob("*") if p.is_file()) \
        if (run_dir / "logs").is_dir() else proc.stderr
    assert "weights by ipc" in logs
    assert "engine sleeps while it waits for a version" in logs
    rows = read_metrics(run_dir)
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 4]  # sync: one version per step
    assert all(r.get("transport_fallbacks", 0) == 0 and r.get("sync_failures", 0) == 0
               for r in rows), "a swap fell back to the file"
    assert_no_process_left(tag)
