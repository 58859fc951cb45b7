"""The learner's end of the weight routes (``sync.routes``): which route each producer gets,
and what the learner publishes for a version on each.

Every version is packed once (``capture``, the only weight copy on the training path) and
written as a snapshot file from that buffer (``sync.writer``, by the learner loop): the file
route, and the fallback of every other. Producers on a route with a learner end (ipc, nccl:
``sync.routes.learner_ends``) also get that buffer, held among the newest versions in
``sync.routes.gpu_copy.GpuCopies``: each end exports what its producers need (``publish``),
adds its fields to the Announce (``offer``: IPC handles, NCCL link offers), keeps its links up
(``maintain``) and answers their SyncReady messages (``on_sync_ready``). A sharded (ZeRO-3)
learner packs into host memory instead, gathering ``sync.bucket_mb`` at a time, and its
GPU-route producers take each version bucket by bucket (``capture_device``). With
``sync.serve_stream`` the snapshot files are also served over the network, for producers on the
stream route (``serve_stream``).

Invariants: a producer gets a GPU route only while that route has a learner end here (a CUDA
learner whose ``sync.route`` is not ``file``); only producers alive now are offered a GPU copy
(an IPC export never opened would leak); a failed GPU copy is counted and leaves the file.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from buffer.protocol import SyncReady
from pipeline.config import RunConfig
from pipeline.keys import curve_keys
from pipeline.learner.producers import ProducerInfo
from pipeline.owner import owned_name
from sync.packing import Layout, pack_buckets, plan_layout, plan_layout_of, total_bytes
from sync.routes.base import RouteChoiceError, choose_route

log = logging.getLogger(__name__)


def snapshot_dir(configured: str, run_dir: Path, run_key: str, need_bytes: int,
                 shm: Path = Path("/dev/shm")) -> Path:
    """Where snapshots go: the configured dir, else shared memory (no disk I/O) when it has
    room for ``need_bytes`` (the kept snapshots and the one being written), else run_dir.
    Docker's default /dev/shm is 64 MB: the first snapshot write would fail there."""
    if configured:
        return Path(configured)
    if shm.is_dir():
        # Named with the launcher's owner tag: a learner it restarts reuses (and prunes) it,
        # and a later run reclaims it should that launcher be killed (pipeline.launch.shm).
        mine = shm / owned_name(run_key)
        free = shutil.disk_usage(shm).free + sum(
            f.stat().st_size for f in mine.rglob("*") if f.is_file())
        if free >= need_bytes:
            return mine
        log.warning("%s has %.1f GB free, snapshots need %.1f GB: writing them under %s "
                    "(set sync.snapshot_dir to choose)", shm, free / 1e9, need_bytes / 1e9,
                    run_dir / "snapshots")
    return run_dir / "snapshots"


def capture_device(model_device: Any, copies_device: Any, gpu_routes: bool,
                   sharded: bool) -> Any:
    """Where a version's packed buffer goes (a ``torch.device``).

    - A sharded learner (ZeRO-3): host memory, whatever the routes, so no GPU ever holds a
      second whole model beside the shards and the engine; ipc and nccl producers then get
      the version bucket by bucket through one bucket of GPU memory (``sync.routes``).
    - Live ipc/nccl producers of an unsharded learner: the GPU copies' GPU, whatever the
      model's state is on. Packing "next to the tensors" put a ZeRO-3 learner's buffer on the
      CPU (its state dict is gathered there): every IPC export then failed ("ipc_export needs
      a contiguous CUDA buffer at storage offset 0") and each version fell back to the file.
    - An unsharded model on a GPU: that GPU (a device-local copy, milliseconds; the writer
      copies it to the host on a side stream while training goes on).
    - Otherwise (CPU): host memory."""
    import torch

    if sharded:
        return torch.device("cpu")
    if gpu_routes and copies_device is not None:
        return torch.device(copies_device)
    model_device = torch.device(model_device)
    return model_device if model_device.type == "cuda" else torch.device("cpu")


def versions_on_host(sharded: bool, host_copies: bool | None) -> bool:
    """Whether versions are packed into host memory (``capture_device``'s ``sharded`` case): a
    sharded learner's always, an unsharded one's where ``sync.host_copies`` (the memory plan,
    ``pipeline.memory_plan``) keeps its GPU for training."""
    return sharded or bool(host_copies)


class LearnerRoutes:
    """The routes of the producers in ``producers`` (the learner's table, shared), the learner
    ends of the GPU routes with their packed copies, and the counters of failed GPU copies
    (``counters``, the learner's, shared)."""

    def __init__(self, cfg: RunConfig, trainer: Any, producers: dict[str, ProducerInfo],
                 counters: dict[str, int]):
        self.cfg, self.trainer = cfg, trainer
        self.producers, self.counters = producers, counters
        self.learner_gpu: str | None = None  # set by start() when the trainer is on CUDA
        self.copies: Any = None  # sync.routes.gpu_copy.GpuCopies, for the GPU routes
        self.ends: dict[str, Any] = {}  # their learner ends by route name (sync.routes)
        self.capture_buckets = 0  # buckets of the last capture
        self._tasks: set[asyncio.Task] = set()  # transfers under way (SyncReady)

    def start(self) -> None:
        """On a CUDA learner: its GPU, and the GPU routes' learner ends unless ``sync.route``
        is file."""
        dev = self.trainer.device
        if dev.type != "cuda":
            return
        import torch

        from sync.routes import learner_ends
        from sync.routes.gpu_copy import GpuCopies

        self.learner_gpu = str(torch.cuda.get_device_properties(dev).uuid)
        if self.cfg.sync.route != "file":
            self.copies = GpuCopies(dev, bucket_bytes=int(self.cfg.sync.bucket_mb * 2**20))
            self.ends = learner_ends(self.copies, timeout_s=self.cfg.sync.nccl_timeout_s)

    def device_capture_bytes(self) -> int:
        """Bytes of a version's buffer when ``capture`` puts it on a GPU (the writer then
        copies it to host memory through a pinned buffer of this size), else 0."""
        tr = self.trainer
        plan = tr.snapshot_plan()
        if plan is None or tr.device.type != "cuda":
            return 0
        device = capture_device(tr.device, getattr(self.copies, "device", None),
                                self.copies is not None,
                                versions_on_host(tr.sharded, self.cfg.sync.host_copies))
        return total_bytes(plan_layout_of(plan)) if device.type == "cuda" else 0

    def release_host_memory(self) -> None:
        """Before the final checkpoint: drop the host-held versions and return the pinned
        memory torch's caching host allocator keeps for them (one buffer a version, up to
        four alive at once) to the system. At 7B that was 135 GB of rank 0's host memory, and
        the final checkpoint's copy beside it was killed by the kernel's OOM killer."""
        import torch

        if not torch.cuda.is_available():
            return
        before = _resident_bytes()
        dropped = self.copies.drop_host_versions() if self.copies is not None else 0
        gc.collect()
        empty = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds only
        if empty is not None:
            empty()
        log.info("before the final checkpoint: %d host-held version(s) dropped, resident "
                 "memory %.1f -> %.1f GB", dropped, before / 1e9, _resident_bytes() / 1e9)

    def close(self) -> None:
        for end in self.ends.values():
            end.close()
        if self.copies is not None:
            self.copies.close()

    def choose(self, producer_id: str, devices: list[str]) -> str:
        """This producer's weight route; an impossible explicit choice is an error in the
        log and the file (placement is only known once the producer has said hello)."""
        try:
            route = choose_route(self.cfg.sync.route, self.learner_gpu, devices)
        except RouteChoiceError as e:
            log.error("producer %s: sync.route: %s; it gets weights from the snapshot file",
                      producer_id, e)
            return "file"
        return route if route in self.ends else "file"  # no learner end here: the file

    def forget(self, producer_id: str) -> None:
        """A new process of ``producer_id``: its link died with the old one."""
        for end in self.ends.values():
            end.forget(producer_id)

    def on_sync_ready(self, msg: SyncReady) -> None:
        """Handed to the learner end of the producer's route; what it has to do at length
        (a join, a send) runs as a task."""
        info = self.producers.get(msg.producer_id)
        end = self.ends.get(info.route) if info is not None else None
        if end is None:
            log.warning("SyncReady from %s but no GPU route here; ignored", msg.producer_id)
            return
        coro = end.on_sync_ready(msg.producer_id, msg.purpose, msg.epoch, msg.version)
        if coro is None:
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def live_gpu_routes(self) -> dict[str, str]:
        """GPU routes of the producers alive now. A dead one gets no IPC export: torch keeps
        an exported buffer until its user releases it, so one never opened would leak."""
        now = time.monotonic()
        # list(): also called from the snapshot thread while the loop may add producers.
        return {p: i.route for p, i in list(self.producers.items())
                if i.route in self.ends and i.alive(now)}

    def offer(self, version: int) -> tuple[dict[str, str], dict[str, Any]]:
        """The Announce's ``routes`` and ``transfer``: the newest GPU copy held, at most
        ``version``, for the live GPU-route producers (({}, {}) when there is none)."""
        if self.copies is None:
            return {}, {}
        routes = self.live_gpu_routes()
        gpu_version = self.copies.newest(version) if routes else None
        transfer = self.copies.payload(gpu_version) if gpu_version is not None else {}
        if not transfer:
            return {}, {}
        for name, end in self.ends.items():
            transfer |= end.offer(gpu_version, _on(routes, name))
        return routes, transfer

    def on_gpu(self, version: int) -> bool:
        """Whether the GPU copy of ``version`` is on offer (GPU-route producers may take it
        before its file is written)."""
        return self.copies is not None and self.copies.newest(version) == version

    def maintain(self) -> None:
        """Every announce: each learner end keeps what its producers need set up (nccl: a link
        offered to every live one)."""
        now = time.monotonic()
        for name, end in self.ends.items():
            end.maintain({p: (i.alive(now), 1 + len(i.devices))
                          for p, i in self.producers.items() if i.route == name})

    def publish(self, version: int, flat: Any, layout: Layout, routes: dict[str, str]) -> None:
        """Hold ``flat`` as ``version``'s GPU copy for the producers in ``routes`` (blocking):
        each learner end first exports what its producers need (ipc: a handle each), then the
        version goes on offer, so no announce offers it before that."""
        packed = self.copies.prepare(version, flat, layout)
        for name, end in self.ends.items():
            end.export(packed, _on(routes, name))
        self.copies.hold(packed)

    def capture(self, version: int) -> tuple[Any, Layout]:
        """Pack the weights into one buffer (blocking: run in a thread), bucket by bucket.

        The only weight copy on the training path: the next step may change the parameters at
        once. The layout is planned before anything is copied (``trainer.snapshot_plan``), and
        the weights arrive ``sync.bucket_mb`` at a time (``trainer.snapshot_buckets``: under
        ZeRO-3 one all-gather per bucket, so the whole model is never gathered anywhere but in
        this buffer). Where the buffer lives: ``capture_device``. Producers on a GPU route are
        offered it right away (``publish``); the snapshot file is written from it by the
        learner's writer, in the background."""
        import torch

        tr = self.trainer
        routes = self.live_gpu_routes()
        gpu_routes = self.copies is not None and bool(routes)
        plan = tr.snapshot_plan()
        # LoRA versions are computed from the whole state (merged, or the adapter alone).
        tensors = tr.snapshot_tensors() if plan is None else None
        layout = plan_layout(tensors) if tensors is not None else plan_layout_of(plan)
        device = capture_device(tr.device, getattr(self.copies, "device", None),
                                gpu_routes,
                                versions_on_host(tr.sharded, self.cfg.sync.host_copies))
        try:
            flat = torch.empty(total_bytes(layout), dtype=torch.uint8, device=device,
                               pin_memory=device.type == "cpu" and torch.cuda.is_available())
        except torch.OutOfMemoryError as e:  # no room for a GPU copy: the file still works
            self.count_failure(version, e)
            gpu_routes, device = False, torch.device("cpu")
            flat = torch.empty(total_bytes(layout), dtype=torch.uint8,
                               pin_memory=torch.cuda.is_available())
        buckets = [tensors] if tensors is not None else \
            tr.snapshot_buckets(int(self.cfg.sync.bucket_mb * 2**20))
        self.capture_buckets = pack_buckets(buckets, layout, flat)
        if gpu_routes:
            try:
                self.publish(version, flat, layout, routes)
            except Exception as e:  # e.g. an IPC export failed: the file still works
                self.count_failure(version, e)
        elif flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # the writer's stream reads it
        return flat, layout

    def count_failure(self, version: int, e: BaseException) -> None:
        self.counters["gpu_publish_failures"] = self.counters.get("gpu_publish_failures", 0) + 1
        log.error("v%d: GPU copy for ipc/nccl producers failed (%r); they load it from the "
                  "snapshot file", version, e)


def serve_stream(cfg: RunConfig, directory: Path) -> Any:
    """The stream route's learner side: with ``sync.serve_stream``, a
    ``sync.stream.SnapshotServer`` on it serving the snapshot files in ``directory``, for
    producers on machines that do not share this one's filesystem (None without)."""
    if not cfg.sync.serve_stream:
        return None
    from sync.stream import SnapshotServer, StreamKeys

    curve = curve_keys(cfg, "learner")
    keys = StreamKeys(curve.server_public, curve.server_secret, curve.client_public) \
        if curve is not None else None
    server = SnapshotServer(cfg.sync.serve_stream, [directory], keys)
    log.info("serving snapshot files at %s", server.addr)
    return server


def _on(routes: dict[str, str], name: str) -> list[str]:
    """The producers of ``routes`` ({producer id: route}) on route ``name``."""
    return [p for p, r in routes.items() if r == name]


def _resident_bytes() -> int:
    """This process's resident memory (pinned buffers included)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
