"""The ipc route (learner and engine on the same GPU), both ends.

Learner end (``IpcLearnerEnd``): the version packed into one GPU buffer
(``sync.routes.gpu_copy``) is exported by CUDA IPC, one handle per producer, and announced as
plain msgpack fields. A sharded learner keeps the version in host memory instead (no room for a
second model on its GPU): each producer gets two bucket slots on the learner's GPU, exported once,
and the learner fills them bucket by bucket when the producer says it waits (``sync.slots``).

Producer end (``IpcRoute``): workers open the handle (stage: a mapping, no copy) and
``load_weights`` reads the learner's memory directly (apply). Bucketed: stage opens the two
slots, and inside the pause the producer tells the learner it waits (``SyncReady``) and loads
each bucket as the learner fills a slot. The worker calls are ``sync_ipc_stage`` and
``sync_ipc_receive`` of ``sync.worker_ext.WeightSyncExtension``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from sync.packing import ipc_export
from sync.routes.base import LearnerEnd, Step, WeightRoute
from sync.routes.gpu_copy import GpuCopies, PackedVersion
from sync.slots import ControlBlock, control_path, serve_buckets
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- producer end
def ipc_unusable(transfer: dict[str, Any], producer_id: str, my_gpus: list[str]) -> str:
    """Why an announced version cannot come by IPC to this producer ("" when it can): the
    announce must carry our own handle, for the GPU our workers are on."""
    handles = transfer.get("ipc")
    ipc = handles.get(producer_id) if isinstance(handles, dict) else None
    if not isinstance(ipc, dict) or "layout" not in transfer:
        return "announce has no IPC handle for this producer"
    if not my_gpus or any(g != ipc.get("gpu_uuid") for g in my_gpus):
        return (f"IPC handle is for GPU {ipc.get('gpu_uuid')}, this engine is on "
                f"{my_gpus or 'cpu'}")
    return ""


class IpcRoute(WeightRoute):
    """Producer end of CUDA IPC. Whole: the learner's packed buffer is opened at stage and read
    by the apply. Bucketed (a sharded learner, whose version waits in host memory): stage opens
    its two bucket slots; the apply tells the learner we are paused (``send_ready``, as for
    NCCL) and loads each bucket as the learner fills a slot (``sync.slots``)."""

    name = "ipc"

    def __init__(self, engine: Any, producer_id: str,
                 send_ready: Callable[[str, int, int], Awaitable[None]] | None = None,
                 timeout_s: float = 30.0):
        super().__init__(engine)
        self.producer_id = producer_id  # whose handle in the payload's {producer id: handle}
        self.send_ready, self.timeout_s = send_ready, timeout_s
        self._bucketed: int | None = None  # the version staged bucketed

    @staticmethod
    def unusable(transfer: dict[str, Any], producer_id: str, my_gpus: list[str],
                 joined: bytes | None) -> str:
        return ipc_unusable(transfer, producer_id, my_gpus)

    def steps(self, ref: SnapshotRef, transfer: dict[str, Any]) -> tuple[Step, Step | None]:
        return partial(self.apply, ref.version), partial(self.stage, ref, transfer)

    async def stage(self, ref: SnapshotRef, transfer: dict[str, Any]) -> dict[str, float]:
        """Open the learner's packed buffer (or bucket slots) for ``ref.version`` and check its
        layout (no copy, no pause needed). ``ref`` (the file snapshot) becomes the worker's
        rollback target."""
        fields = transfer["ipc"][self.producer_id]
        self._bucketed = ref.version if "slots" in fields else None
        return await self._rpc("sync_ipc_stage", ref.version, fields, transfer["layout"],
                               ref.uri, ref.checksum)

    async def apply(self, version: int) -> dict[str, float]:
        if self._bucketed != version:
            return await super().apply(version)
        self._bucketed = None
        if self.send_ready is None:
            raise RuntimeError("bucketed IPC needs send_ready (the learner serves on request)")
        await self.send_ready("weights", 0, version)
        got = await self._rpc("sync_ipc_receive", version, self.timeout_s)
        return got | await super().apply(version)


# ---------------------------------------------------------------------- learner end
@dataclass
class Slots:
    """One producer's two bucket slots on the learner's GPU, exported once, and the shared
    control block of their hand-over (``sync.slots``)."""

    tensors: list[torch.Tensor]
    handles: list[dict[str, Any]]
    control: ControlBlock
    lock: threading.Lock
    # One side stream for every hand-over, never the training stream: the caching allocator
    # reuses a freed block only on the stream it was made on, so a new stream a version (torch
    # hands out up to 32 from its pool) kept each version's temporaries (the checksum's) cached.
    stream: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        return self.tensors[0].numel()


class IpcLearnerEnd(LearnerEnd):
    """Exports each held version to the ipc producers: a version on our GPU whole (one handle
    per producer), a version in host memory through each producer's two bucket slots, served
    when the producer says it waits (``on_sync_ready``)."""

    name = "ipc"

    def __init__(self, copies: GpuCopies, timeout_s: float = 30.0,
                 shm_dir: str = "/dev/shm"):
        super().__init__(copies, timeout_s)
        self.shm_dir = shm_dir
        self._exports: dict[int, dict[str, dict]] = {}  # version -> {producer id: IPC fields}
        self._slots: dict[str, Slots] = {}
        self._lock = threading.Lock()
        self.sends = 0
        self.send_failures = 0

    def export(self, packed: PackedVersion, producers: list[str]) -> None:
        """One handle per producer, not one shared: torch counts the users of an exported
        buffer per export, and frees (or reuses) it once that count is 0 and we dropped it.
        With one export and two producers, the first release would let a slower producer read
        reused memory."""
        copies = self.copies
        with torch.cuda.device(copies.device):
            if packed.flat.is_cuda:
                fields = {pid: ipc_export(packed.flat, copies.gpu_uuid) for pid in producers}
            else:
                biggest = max((e - s for s, e in packed.ranges), default=0)
                fields = {pid: self._slot_fields(pid, biggest, packed.ranges)
                          for pid in producers}
        held = set(copies.held())
        with self._lock:
            self._exports[packed.version] = fields
            for v in [v for v in self._exports if v != packed.version and v not in held]:
                del self._exports[v]

    def offer(self, version: int, producers: list[str]) -> dict[str, Any]:
        with self._lock:
            fields = self._exports.get(version, {})
        ipc = {pid: fields[pid] for pid in producers if pid in fields}
        return {"ipc": ipc} if ipc else {}  # {producer id: its own handle fields}

    def on_sync_ready(self, producer_id: str, purpose: str, epoch: int, version: int
                      ) -> Coroutine[Any, Any, Any] | None:
        if purpose == "weights" and producer_id in self._slots:
            return self.send(producer_id, version)
        return super().on_sync_ready(producer_id, purpose, epoch, version)

    def _slot_fields(self, producer_id: str, nbytes: int, ranges: list[tuple[int, int]]
                     ) -> dict[str, Any]:
        """The IPC fields of ``producer_id``'s two slots (made, or made larger, on demand; an
        old pair stays alive while its producer still maps it, as any IPC export does)."""
        slots = self._slots.get(producer_id)
        if slots is None or slots.nbytes < nbytes:
            if slots is not None:
                slots.control.close()
            tensors = [torch.empty(nbytes, dtype=torch.uint8, device=self.copies.device)
                       for _ in range(2)]
            path = control_path(self.shm_dir, os.getpid(), producer_id)
            slots = Slots(tensors, [ipc_export(t, self.copies.gpu_uuid) for t in tensors],
                          ControlBlock(path, create=True), threading.Lock())
            self._slots[producer_id] = slots
        return {"slots": slots.handles, "control": slots.control.path,
                "buckets": [[s, e] for s, e in ranges], "gpu_uuid": self.copies.gpu_uuid}

    async def send(self, producer_id: str, version: int) -> str:
        """The producer is paused for ``version``: hand it over bucket by bucket through its
        slots. Returns ``send``, ``refuse`` (not held in host memory: it loads the file) or
        ``failed``."""
        slots = self._slots[producer_id]
        packed = self.copies.get(version)
        held = packed is not None and not packed.flat.is_cuda
        try:
            await asyncio.to_thread(self._send_blocking, slots, version,
                                    packed if held else None)
        except Exception as e:
            self.send_failures += 1
            log.error("IPC hand-over of v%d to %s failed (%r); it loads the snapshot file",
                      version, producer_id, e)
            return "failed"
        self.sends += int(held)
        return "send" if held else "refuse"

    def _send_blocking(self, slots: Slots, version: int, packed: PackedVersion | None) -> None:
        device = self.copies.device
        deadline = time.monotonic() + self.timeout_s
        with slots.lock, torch.cuda.device(device):
            if slots.stream is None:
                slots.stream = torch.cuda.Stream(device)
            with torch.cuda.stream(slots.stream):
                serve_buckets(slots.control, version, None if packed is None else packed.flat,
                              [] if packed is None else packed.ranges, slots.tensors, deadline)

    def close(self) -> None:
        with self._lock:
            self._exports.clear()
        for slots in self._slots.values():
            slots.control.close()
            with contextlib.suppress(OSError):
                os.unlink(slots.control.path)
        self._slots.clear()
