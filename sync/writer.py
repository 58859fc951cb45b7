"""The learner's snapshot-file writer: off the training path, newest version wins.

The training step only packs the weights into one buffer on the model's device (a device-local
copy, ``sync.packing``). Everything slower happens here, in the background: the copy to host
memory (on a side CUDA stream into a pinned buffer, so it overlaps the next training step), the
file write and its checksum (``sync.snapshot.write_packed``). Producers that take weights by CUDA
IPC or NCCL do not wait for any of it; producers on the file route, and any producer that needs
to catch up or roll back, use the file once ``on_written`` has announced it.

Latest wins: while one version is being written, a newer submitted version replaces a pending
one that has not started (``skipped`` counts those). Every producer only ever needs the newest
version, so under load the writer falls behind by at most one file, never by a queue.
A write that fails is re-raised on the next ``submit`` or ``flush``, on the training path: a run
that cannot write snapshots must stop, not go on without a fallback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sync.packing import Layout
from sync.snapshot import SnapshotRef, prune_snapshots, write_packed

log = logging.getLogger(__name__)
OnWritten = Callable[[SnapshotRef, float], Awaitable[None]]


@dataclass
class _Job:
    version: int
    flat: torch.Tensor  # packed weights, on the learner's device or the CPU; never modified
    layout: Layout


class SnapshotWriter:
    def __init__(self, directory: str | Path, keep: int, on_written: OnWritten | None = None):
        self.directory = Path(directory)
        self.keep = keep
        self.on_written = on_written
        self.skipped = 0          # versions replaced by a newer one before their write began
        self.written: SnapshotRef | None = None
        self._pending: _Job | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._pinned: torch.Tensor | None = None  # reused host buffer for device copies
        self._stream = None  # side CUDA stream for the device -> host copy

    def prepare(self, nbytes: int) -> None:
        """Allocate the pinned host buffer for versions packed on a GPU (``nbytes`` of them; 0:
        none) before training starts. Page-locking gigabytes takes seconds and holds the CUDA
        driver; at the first version it would stall the training thread's CUDA calls."""
        if nbytes > 0 and torch.cuda.is_available():
            self._pinned_of(nbytes)

    def _pinned_of(self, n: int) -> torch.Tensor:
        """The reused pinned host buffer, grown to ``n`` bytes if smaller."""
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = None  # free the old one before asking for a larger one
            self._pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return self._pinned

    # ------------------------------------------------------------------ training side
    def submit(self, version: int, flat: torch.Tensor, layout: Layout) -> None:
        """Queue ``version`` for writing (returns at once). ``flat`` must not change after."""
        self._raise_if_failed()
        if self._pending is not None:
            self.skipped += 1
            log.debug("snapshot v%d not written: v%d replaces it", self._pending.version,
                      version)
        self._pending = _Job(version, flat, layout)
        self._idle.clear()
        self._wake.set()

    async def flush(self) -> SnapshotRef | None:
        """Wait until everything submitted is written (or skipped); raise a write's error."""
        await self._idle.wait()
        self._raise_if_failed()
        return self.written

    async def write_now(self, version: int, flat: torch.Tensor, layout: Layout) -> SnapshotRef:
        """Write ``version`` at once, outside the queue and without ``on_written`` (a resumed
        learner's first snapshot, written before anything is announced)."""
        self._raise_if_failed()
        self.written = await asyncio.to_thread(self._write, _Job(version, flat, layout))
        return self.written

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing a snapshot file failed: {self._error!r}") \
                from self._error

    # ------------------------------------------------------------------ background
    async def run(self) -> None:
        """The writer's loop; run it as a task for the learner's lifetime."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            job, self._pending = self._pending, None
            if job is None:
                continue
            try:
                t0 = time.monotonic()
                ref = await asyncio.to_thread(self._write, job)
                self.written = ref
                if self.on_written is not None:
                    await self.on_written(ref, time.monotonic() - t0)
            except Exception as e:  # kept for the training path to raise
                log.error("snapshot v%d: write failed: %r", job.version, e)
                self._error = e
            finally:
                del job
                if self._pending is None:
                    self._idle.set()
                else:
                    self._wake.set()

    def _write(self, job: _Job) -> SnapshotRef:
        host = self._to_host(job.flat)
        ref = write_packed(host, job.layout, job.version, self.directory)
        prune_snapshots(self.directory, self.keep)
        return ref

    def _to_host(self, flat: torch.Tensor) -> torch.Tensor:
        """The packed bytes in host memory; a device buffer goes through the pinned one on a
        side stream (the training stream never waits for it)."""
        if flat.device.type == "cpu":
            return flat
        n = flat.numel()
        host = self._pinned_of(n)[:n]
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=flat.device)
        with torch.cuda.stream(self._stream):
            host.copy_(flat[:n], non_blocking=True)
        self._stream.synchronize()
        return host
