"""The packed copy of the newest versions that the GPU routes (ipc, nccl) share, learner side.

For each of the ``keep`` newest versions, one packed uint8 buffer (``sync.packing``), a copy
taken when the version is published, so training can go on updating the parameters while
producers read or receive that version: on the learner's GPU, or in host memory for a sharded
learner (no room for a second model on its GPU; the routes then hand it over bucket by bucket).
What each route adds to it is that route's learner end: ``sync.routes.ipc.IpcLearnerEnd`` (its
CUDA IPC handles or bucket slots), ``sync.routes.nccl.NcclLearnerEnd`` (a link per producer).

Publishing a version is two steps, so that no announce offers it before every route is ready for
it: ``prepare`` (the pack is complete), each learner end's ``export``, then ``hold`` (on offer).
An IPC-exported buffer that a producer still maps stays alive after we drop it (torch's CUDA IPC
reference counter), so dropping an old version never pulls memory from under a reader.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sync.packing import Layout, bucket_ranges, layout_to_wire, pack, plan_layout


def indexed_device(device: torch.device | str, current: Callable[[], int]) -> torch.device:
    """``device`` with its index: ``cuda`` -> ``cuda:N`` (N = ``current()``, the current
    device). vLLM's PyNcclCommunicator checks ``tensor.device == its device``, and a tensor is
    always on ``cuda:N``: a bare ``cuda`` (a single-process learner's device) fails every link
    with "created to work on cuda, but the input tensor is on cuda:0"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current())
    return device


@dataclass(frozen=True)
class PackedVersion:
    """One version's packed buffer (never modified once prepared), its layout, and the byte
    ranges of its buckets (``sync.bucket_mb``)."""

    version: int
    flat: torch.Tensor
    layout: Layout
    ranges: list[tuple[int, int]]


class GpuCopies:
    """The newest ``keep`` versions, packed, on ``device`` (``gpu_uuid``: that GPU's UUID)."""

    def __init__(self, device: torch.device | str, *, keep: int = 2,
                 gpu_uuid: str | None = None, bucket_bytes: int = 1 << 30):
        self.device = indexed_device(device, torch.cuda.current_device)
        self.gpu_uuid = gpu_uuid or str(torch.cuda.get_device_properties(self.device).uuid)
        self.keep, self.bucket_bytes = keep, bucket_bytes
        self._held: OrderedDict[int, PackedVersion] = OrderedDict()
        self._lock = threading.Lock()

    def pack(self, version: int, tensors: dict[str, torch.Tensor]) -> PackedVersion:
        """``tensors`` packed (a copy) on our device and prepared as ``version``. Blocking."""
        layout = plan_layout(tensors)
        with torch.cuda.device(self.device):
            flat = pack(tensors, layout, self.device)
        return self.prepare(version, flat, layout)

    def prepare(self, version: int, flat: torch.Tensor, layout: Layout) -> PackedVersion:
        """An already packed ``version`` (on our device or in host memory), its pack complete;
        not on offer until ``hold``."""
        ranges = bucket_ranges(layout, self.bucket_bytes)
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).synchronize()  # the pack is complete
        return PackedVersion(version, flat, layout, ranges)

    def hold(self, packed: PackedVersion) -> None:
        """Put ``packed`` on offer, dropping the oldest beyond ``keep``."""
        with self._lock:
            self._held[packed.version] = packed
            while len(self._held) > self.keep:
                self._held.popitem(last=False)
        torch.cuda.ipc_collect()  # free old buffers no producer maps any more

    def get(self, version: int) -> PackedVersion | None:
        with self._lock:
            return self._held.get(version)

    def drop_host_versions(self) -> int:
        """Let go of the versions held in host memory (a sharded learner's) and return how
        many: at the end of a run they are pinned memory nobody will ask for again, which the
        final checkpoint's copy of the training state needs (at 7B, 15 GB each). A producer
        that asks for one afterwards is told it is gone and loads the snapshot file."""
        with self._lock:
            gone = [v for v, p in self._held.items() if not p.flat.is_cuda]
            for v in gone:
                del self._held[v]
        return len(gone)

    def newest(self, at_most: int) -> int | None:
        """The newest version held that is not newer than ``at_most``."""
        with self._lock:
            held = [v for v in self._held if v <= at_most]
        return max(held) if held else None

    def held(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def payload(self, version: int) -> dict[str, Any]:
        """What every GPU route's Announce ``transfer`` carries for ``version`` (plain msgpack
        data; {} when it is not held): the learner ends add their own fields."""
        packed = self.get(version)
        if packed is None:
            return {}
        return {"version": version, "layout": layout_to_wire(packed.layout),
                "buckets": [[s, e] for s, e in packed.ranges]}

    def close(self) -> None:
        with self._lock:
            self._held.clear()
