"""The learner's end of the weight routes (``sync.routes``): which route each producer gets,
and what the learner publishes for a version on each.

Every version is packed once (``capture``, the only weight copy on the training path) and
written as a snapshot file from that buffer (``sync.writer``, by the learner loop): the file
route, and the fallback of every other. Producers whose route has a GPU copy (``gpu_copy``:
ipc, nccl) also get the packed buffer from ``sync.publish.WeightPublisher``: its IPC handle
(``ipc_export``) or NCCL link offer (``linked``) rides in the Announce (``offer``), and SyncReady
messages drive the NCCL side of each transfer (``on_sync_ready``). A sharded (ZeRO-3) learner
packs into host memory instead, gathering ``sync.bucket_mb`` at a time, and its GPU-route
producers take each version bucket by bucket (``capture_device``). With ``sync.serve_stream``
the snapshot files are also served over the network, for producers on the stream route
(``serve_stream``).

Invariants: a producer gets a GPU route only while a publisher exists (a CUDA learner whose
``sync.transport`` is not ``file``); only producers alive now are offered a GPU copy (an IPC
export never opened would leak); a failed GPU copy is counted and leaves the file.
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
from pipeline.learner.producers import ALIVE_S, ProducerInfo
from pipeline.owner import owned_name
from sync.packing import Layout, pack_buckets, plan_layout, plan_layout_of, total_bytes
from sync.routes import route_class
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


def capture_device(model_device: Any, publisher_device: Any, gpu_routes: bool,
                   sharded: bool) -> Any:
    """Where a version's packed buffer goes (a ``torch.device``).

    - A sharded learner (ZeRO-3): host memory, whatever the routes, so no GPU ever holds a
      second whole model beside the shards and the engine; ipc and nccl producers then get
      the version bucket by bucket through one bucket of GPU memory (``sync.publish``).
    - Live ipc/nccl producers of an unsharded learner: the publisher's GPU, whatever the
      model's state is on. Packing "next to the tensors" put a ZeRO-3 learner's buffer on the
      CPU (its state dict is gathered there): every IPC export then failed ("ipc_export needs
      a contiguous CUDA buffer at storage offset 0") and each version fell back to the file.
    - An unsharded model on a GPU: that GPU (a device-local copy, milliseconds; the writer
      copies it to the host on a side stream while training goes on).
    - Otherwise (CPU): host memory."""
    import torch

    if sharded:
        return torch.device("cpu")
    if gpu_routes and publisher_device is not None:
        return torch.device(publisher_device)
    model_device = torch.device(model_device)
    return model_device if model_device.type == "cuda" else torch.device("cpu")


class LearnerRoutes:
    """The routes of the producers in ``producers`` (the learner's table, shared), the GPU
    publisher, and the counters of failed GPU copies (``counters``, the learner's, shared)."""

    def __init__(self, cfg: RunConfig, trainer: Any, producers: dict[str, ProducerInfo],
                 counters: dict[str, int]):
        self.cfg, self.trainer = cfg, trainer
        self.producers, self.counters = producers, counters
        self.learner_gpu: str | None = None  # set by start() when the trainer is on CUDA
        self.publisher: Any = None  # sync.publish.WeightPublisher, for the GPU routes
        self.capture_buckets = 0  # buckets of the last capture
        self._tasks: set[asyncio.Task] = set()  # transfers under way (SyncReady)

    def start(self) -> None:
        """On a CUDA learner: its GPU, and a publisher unless ``sync.transport`` is file."""
        dev = self.trainer.device
        if dev.type != "cuda":
            return
        import torch

        from sync.publish import WeightPublisher

        self.learner_gpu = str(torch.cuda.get_device_properties(dev).uuid)
        if self.cfg.sync.transport != "file":
            self.publisher = WeightPublisher(dev, timeout_s=self.cfg.sync.nccl_timeout_s,
                                             bucket_bytes=int(self.cfg.sync.bucket_mb * 2**20))

    def device_capture_bytes(self) -> int:
        """Bytes of a version's buffer when ``capture`` puts it on a GPU (the writer then
        copies it to host memory through a pinned buffer of this size), else 0."""
        tr = self.trainer
        plan = tr.snapshot_plan()
        if plan is None or tr.device.type != "cuda":
            return 0
        device = capture_device(tr.device, getattr(self.publisher, "device", None),
                                self.publisher is not None, tr.sharded)
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
        dropped = self.publisher.drop_host_versions() if self.publisher is not None else 0
        gc.collect()
        empty = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds only
        if empty is not None:
            empty()
        log.info("before the final checkpoint: %d host-held version(s) dropped, resident "
                 "memory %.1f -> %.1f GB", dropped, before / 1e9, _resident_bytes() / 1e9)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def choose(self, producer_id: str, devices: list[str]) -> str:
        """This producer's weight route; an impossible explicit choice is an error in the
        log and the file (placement is only known once the producer has said hello)."""
        try:
            route = choose_route(self.cfg.sync.transport, self.learner_gpu, devices)
        except RouteChoiceError as e:
            log.error("producer %s: sync.transport: %s; it gets weights from the snapshot file",
                      producer_id, e)
            return "file"
        if route_class(route).gpu_copy and self.publisher is None:
            return "file"
        return route

    def forget(self, producer_id: str) -> None:
        """A new process of ``producer_id``: its link died with the old one."""
        if self.publisher is not None:
            self.publisher.forget(producer_id)

    def on_sync_ready(self, msg: SyncReady) -> None:
        pub = self.publisher
        if pub is None:
            log.warning("SyncReady from %s but no GPU route here; ignored", msg.producer_id)
            return
        if msg.purpose == "drop":
            pub.drop(msg.producer_id, msg.epoch)
            return
        coro = pub.join(msg.producer_id, msg.epoch) if msg.purpose == "link" else \
            pub.send(msg.producer_id, msg.epoch, msg.version)
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def live_gpu_routes(self) -> dict[str, str]:
        """GPU routes of the producers alive now. A dead one gets no IPC export: torch keeps
        an exported buffer until its user releases it, so one never opened would leak."""
        now = time.monotonic()
        # list(): also called from the snapshot thread while the loop may add producers.
        return {p: i.route for p, i in list(self.producers.items())
                if route_class(i.route).gpu_copy and now - i.last_seen <= ALIVE_S}

    def offer(self, version: int) -> tuple[dict[str, str], dict[str, Any]]:
        """The Announce's ``routes`` and ``transfer``: the newest GPU copy held, at most
        ``version``, for the live GPU-route producers (({}, {}) when there is none)."""
        if self.publisher is None:
            return {}, {}
        routes = self.live_gpu_routes()
        gpu_version = self.publisher.newest(version) if routes else None
        if gpu_version is None:
            return {}, {}
        transfer = self.publisher.payload(gpu_version, routes)
        return (routes if transfer else {}), transfer

    def on_gpu(self, version: int) -> bool:
        """Whether the GPU copy of ``version`` is on offer (GPU-route producers may take it
        before its file is written)."""
        return self.publisher is not None and self.publisher.newest(version) == version

    def maintain(self) -> None:
        """Keep a NCCL link offered to every live producer whose route is linked."""
        if self.publisher is None:
            return
        now = time.monotonic()
        self.publisher.maintain({p: (i.alive(now), 1 + len(i.devices))
                                 for p, i in self.producers.items()
                                 if route_class(i.route).linked})

    def capture(self, version: int) -> tuple[Any, Layout]:
        """Pack the weights into one buffer (blocking: run in a thread), bucket by bucket.

        The only weight copy on the training path: the next step may change the parameters at
        once. The layout is planned before anything is copied (``trainer.snapshot_plan``), and
        the weights arrive ``sync.bucket_mb`` at a time (``trainer.snapshot_buckets``: under
        ZeRO-3 one all-gather per bucket, so the whole model is never gathered anywhere but in
        this buffer). Where the buffer lives: ``capture_device``. Producers on a GPU route are
        offered it right away (``sync.publish``); the snapshot file is written from it by the
        learner's writer, in the background."""
        import torch

        tr = self.trainer
        routes = self.live_gpu_routes()
        gpu_routes = self.publisher is not None and bool(routes)
        plan = tr.snapshot_plan()
        # LoRA versions are computed from the whole state (merged, or the adapter alone).
        tensors = tr.snapshot_tensors() if plan is None else None
        layout = plan_layout(tensors) if tensors is not None else plan_layout_of(plan)
        device = capture_device(tr.device, getattr(self.publisher, "device", None),
                                gpu_routes, tr.sharded)
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
                self.publisher.publish_packed(
                    version, flat, layout,
                    ipc=[p for p, r in routes.items() if route_class(r).ipc_export])
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


def _resident_bytes() -> int:
    """This process's resident memory (pinned buffers included)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
