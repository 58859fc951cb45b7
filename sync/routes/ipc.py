"""The ipc route (learner and engine on the same GPU): the learner packs the version into one GPU
buffer (``sync.packing``) and announces its CUDA IPC handle as plain msgpack fields; workers open
it (stage: a mapping, no copy) and ``load_weights`` reads the learner's memory directly (apply).
A sharded learner keeps the version in host memory instead (no room for a second model on its
GPU): the worker opens two bucket slots at stage, and inside the pause tells the learner it waits
(``SyncReady``) and loads each bucket as the learner fills a slot (``sync.slots``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from sync.routes.base import Step, WeightRoute
from sync.snapshot import SnapshotRef


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
    gpu_copy = True
    ipc_export = True

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
