"""Learner side of the GPU weight routes: packed copies of the newest versions, their CUDA IPC
handles, and one NCCL link per producer (the producer side is ``sync.routes``).

Owns, on the learner's GPU: for each of the ``keep`` newest versions, one packed uint8 buffer
(``sync.packing``), a copy taken when the version is published, so training can go on updating
the parameters while producers read or receive that version. An IPC-exported buffer that a
producer still maps stays alive after we drop it (torch's CUDA IPC reference counter), so
dropping an old version never pulls memory from under a reader.

NCCL link life cycle, per producer (the learner is rank 0, the producer's workers 1..TP):
  offered  -- a new epoch and unique id, put in the Announce for that producer;
  joining  -- the producer sent SyncReady("link"): we join in a thread (``ncclCommInitRank``
              blocks until every rank has joined, so we only call it once the producer has
              said it is joining);
  ready    -- weights can flow: each SyncReady("weights", v) is answered with a header broadcast
              (v, bytes), or (-1, 0) if v is no longer held, then the packed buffer;
  dead     -- join or transfer failed or timed out (communicator aborted); the producer falls
              back to the snapshot file, and ``maintain`` offers a new link (new epoch) while the
              producer is alive, up to ``max_link_failures`` in a row.
Every transfer runs in a worker thread on its own CUDA stream with a deadline; nothing here can
block the learner's event loop or its training stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sync import nccl
from sync.packing import (
    Layout,
    bucket_ranges,
    ipc_export,
    layout_to_wire,
    pack,
    plan_layout,
    total_bytes,
)
from sync.slots import ControlBlock, control_path, serve_buckets, word_sum
from sync.threads import in_daemon_thread

log = logging.getLogger(__name__)
LinkState = Literal["offered", "joining", "ready", "dead"]
EXPIRED = "offer not taken up in time"


@dataclass
class Link:
    producer_id: str
    epoch: int
    unique_id: bytes
    world_size: int
    state: LinkState = "offered"
    # When an announce first carried the offer (None: not yet). An offer expires only counted
    # from there: before the first snapshot no announce carries it, and re-minting it every
    # timeout_s would leak a NCCL bootstrap thread per unused unique id.
    since: float | None = None
    comm: Any = None
    error: str = ""

    def offer(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "unique_id": self.unique_id, "world_size": self.world_size,
                "rank_offset": 1}


def ready_reply(link: Link | None, epoch: int, version: int, held: list[int]) -> str:
    """How to answer a producer paused for ``version`` on link ``epoch``: ``send`` it,
    ``refuse`` (header -1: we no longer hold it, it loads the file), or ``ignore`` (no such live
    link: its receive times out and aborts, then it loads the file)."""
    if link is None or link.epoch != epoch or link.state != "ready":
        return "ignore"
    return "send" if version in held else "refuse"


def link_due(link: Link | None, alive: bool, now: float, timeout_s: float, failures: int,
             max_failures: int) -> bool:
    """Whether to offer a new link to a producer (and mark a stale offer dead)."""
    if not alive or failures >= max_failures:
        return False
    if link is None or link.state == "dead":
        return True
    if link.state == "offered" and link.since is not None and now - link.since > timeout_s:
        link.state, link.error = "dead", EXPIRED
        return True
    return False


def link_droppable(link: Link | None, epoch: int) -> bool:
    """Whether a producer's "drop" of ``epoch`` applies to our link (not an older epoch's)."""
    return link is not None and link.epoch == epoch and link.state != "dead"


def permanent_link_error(e: BaseException) -> bool:
    """Whether a failed join will fail again the same way: an error of this process (a bad
    argument or device, no libnccl), not of the peer or the network (a timeout, a NCCL error).
    Such a producer gets no more offers and takes its weights by file, instead of stalling
    ``timeout_s`` on each of ``max_link_failures`` doomed links."""
    return isinstance(e, (AssertionError, TypeError, ValueError, nccl.NcclUnavailable))


def indexed_device(device: torch.device | str, current: Callable[[], int]) -> torch.device:
    """``device`` with its index: ``cuda`` -> ``cuda:N`` (N = ``current()``, the current
    device). vLLM's PyNcclCommunicator checks ``tensor.device == its device``, and a tensor is
    always on ``cuda:N``: a bare ``cuda`` (a single-process learner's device) fails every link
    with "created to work on cuda, but the input tensor is on cuda:0"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current())
    return device


def _abort_in_thread(comm: Any) -> None:
    """Abort a communicator without blocking the caller (an abort can wait on the peer)."""
    if comm is not None:
        threading.Thread(target=nccl.abort, args=(comm,), daemon=True).start()


@dataclass
class Slots:
    """One IPC producer's two bucket slots on the learner's GPU, exported once, and the shared
    control block of their hand-over (``sync.slots``)."""

    tensors: list[torch.Tensor]
    handles: list[dict[str, Any]]
    control: ControlBlock
    lock: threading.Lock

    @property
    def nbytes(self) -> int:
        return self.tensors[0].numel()


class WeightPublisher:
    """Holds the newest versions for the GPU routes. A version packed on our GPU is offered
    whole (one IPC handle per producer, one NCCL broadcast per bucket straight from it). A
    version in host memory (a sharded learner: no room for a second model on the GPU) goes out
    bucket by bucket through one bucket of GPU memory per transfer: NCCL broadcasts from a
    staging bucket, IPC producers get two slots each and a hand-over (``sync.slots``)."""

    def __init__(self, device: torch.device | str, *, timeout_s: float = 30.0, keep: int = 2,
                 max_link_failures: int = 3, gpu_uuid: str | None = None,
                 bucket_bytes: int = 1 << 30, shm_dir: str = "/dev/shm"):
        self.device = indexed_device(device, torch.cuda.current_device)
        self.gpu_uuid = gpu_uuid or str(torch.cuda.get_device_properties(self.device).uuid)
        self.timeout_s, self.keep, self.max_link_failures = timeout_s, keep, max_link_failures
        self.bucket_bytes, self.shm_dir = bucket_bytes, shm_dir
        # version -> (packed buffer, layout, {producer id: IPC fields}, bucket byte ranges)
        self._held: OrderedDict[int, tuple[torch.Tensor, Layout, dict[str, dict],
                                           list[tuple[int, int]]]] = OrderedDict()
        self._slots: dict[str, Slots] = {}
        self._lock = threading.Lock()
        self.links: dict[str, Link] = {}
        self.link_failures: dict[str, int] = {}
        self._epoch = 0
        # Offers that expired before the producer took them up, by (producer, epoch): a late
        # join of one is completed and aborted at once (see ``join``). Only the newest few.
        self._expired: OrderedDict[tuple[str, int], Link] = OrderedDict()
        self.sends = 0
        self.send_failures = 0

    # ------------------------------------------------------------------ versions
    def publish(self, version: int, tensors: dict[str, torch.Tensor],
                ipc: Iterable[str] = ()) -> float:
        """Pack ``tensors`` (a copy) as ``version`` and hold it (see ``publish_packed``).
        Blocking (run it in a thread); returns the seconds it took."""
        t0 = time.perf_counter()
        layout = plan_layout(tensors)
        with torch.cuda.device(self.device):
            flat = pack(tensors, layout, self.device)
        self.publish_packed(version, flat, layout, ipc)
        return time.perf_counter() - t0

    def publish_packed(self, version: int, flat: torch.Tensor, layout: Layout,
                       ipc: Iterable[str] = ()) -> None:
        """Hold an already packed ``version`` (on our device, never modified after) and export
        one IPC handle per producer in ``ipc``.

        One handle each, not one shared: torch counts the users of an exported buffer per
        export, and frees (or reuses) it once that count is 0 and we dropped it. With one
        export and two producers, the first release would let a slower producer read reused
        memory."""
        ranges = bucket_ranges(layout, self.bucket_bytes)
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).synchronize()  # the pack is complete
            if flat.is_cuda:
                handles = {pid: ipc_export(flat, self.gpu_uuid) for pid in ipc}
            else:
                biggest = max((e - s for s, e in ranges), default=0)
                handles = {pid: self._slot_fields(pid, biggest, ranges) for pid in ipc}
        with self._lock:
            self._held[version] = (flat, layout, handles, ranges)
            while len(self._held) > self.keep:
                self._held.popitem(last=False)
        torch.cuda.ipc_collect()  # free old buffers no producer maps any more

    def drop_host_versions(self) -> int:
        """Let go of the versions held in host memory (a sharded learner's) and return how
        many: at the end of a run they are pinned memory nobody will ask for again, which the
        final checkpoint's copy of the training state needs (at 7B, 15 GB each). A producer
        that asks for one afterwards is told it is gone and loads the snapshot file."""
        with self._lock:
            gone = [v for v, entry in self._held.items() if not entry[0].is_cuda]
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

    def payload(self, version: int, routes: dict[str, str]) -> dict[str, Any]:
        """The Announce ``transfer`` field for ``version`` (plain msgpack data)."""
        with self._lock:
            entry = self._held.get(version)
        if entry is None or not routes:
            return {}
        _flat, layout, handles, ranges = entry
        out: dict[str, Any] = {"version": version, "layout": layout_to_wire(layout),
                               "buckets": [[s, e] for s, e in ranges]}
        ipc = {pid: handles[pid] for pid, route in routes.items()
               if route == "ipc" and pid in handles}
        if ipc:
            out["ipc"] = ipc  # {producer id: its own handle fields}
        offers = {}
        for pid, link in list(self.links.items()):
            if routes.get(pid) == "nccl" and link.state in ("offered", "joining", "ready"):
                offers[pid] = link.offer()
                if link.since is None:
                    link.since = time.monotonic()  # the offer's clock starts now
        if offers:
            out["nccl"] = offers
        return out

    # ------------------------------------------------------------------ nccl links
    def maintain(self, nccl_producers: dict[str, tuple[bool, int]]) -> None:
        """Offer a link to each alive NCCL-routed producer that has none that works.
        ``nccl_producers``: {producer id: (alive, world size = 1 + its TP workers)}."""
        now = time.monotonic()
        for pid, (alive, world) in nccl_producers.items():
            link = self.links.get(pid)
            if link_due(link, alive, now, self.timeout_s, self.link_failures.get(pid, 0),
                        self.max_link_failures):
                if link is not None and link.state == "dead":
                    self._drop(link)
                    if link.error == EXPIRED:
                        self._expired[(pid, link.epoch)] = link
                        while len(self._expired) > 8:
                            self._expired.popitem(last=False)
                self._epoch += 1
                self.links[pid] = Link(pid, self._epoch, nccl.new_unique_id(), world)
                log.info("offering NCCL link epoch %d to %s", self._epoch, pid)

    def forget(self, producer_id: str) -> None:
        """A producer restarted: its old link is useless; offer a fresh one (failures reset)."""
        link = self.links.pop(producer_id, None)
        if link is not None:
            link.state = "dead"  # a join still under way aborts what it gets, counts nothing
            self._drop(link)
        self.link_failures.pop(producer_id, None)

    def _drop(self, link: Link) -> None:
        comm, link.comm = link.comm, None
        _abort_in_thread(comm)

    def _fail(self, link: Link, error: str) -> None:
        link.state, link.error = "dead", error
        self.link_failures[link.producer_id] = self.link_failures.get(link.producer_id, 0) + 1
        self._drop(link)

    async def join(self, producer_id: str, epoch: int) -> None:
        """The producer is joining link ``epoch``: join as rank 0 (in a thread)."""
        link = self.links.get(producer_id)
        if link is None or link.epoch != epoch or link.state != "offered":
            stale = self._expired.pop((producer_id, epoch), None)
            if stale is not None:
                # Its engine is already inside ncclCommInitRank, which has no timeout: complete
                # the rendezvous and abort at once, so its engine is not stuck for good; it
                # then takes the newer offer.
                log.warning("%s joins NCCL link epoch %d after that offer expired; completing "
                            "and aborting it", producer_id, epoch)
                threading.Thread(target=self._join_and_abort, args=(stale,), daemon=True).start()
                return
            log.warning("%s joins NCCL link epoch %d, which is not on offer; ignored",
                        producer_id, epoch)
            return
        link.state = "joining"
        try:
            # A producer that dies between its SyncReady and its own join leaks one daemon
            # thread (ncclCommInitRank has no timeout), never the event loop or the exit.
            comm = await asyncio.wait_for(
                in_daemon_thread(self._connect, link, on_orphan=_abort_in_thread),
                self.timeout_s)
            if link.state != "joining":  # the producer dropped it, or restarted, meanwhile
                _abort_in_thread(comm)
                return
            link.comm, link.state = comm, "ready"
            self.link_failures[producer_id] = 0
            log.info("NCCL link epoch %d to %s is up", epoch, producer_id)
        except Exception as e:  # any failure: the producer uses the file
            if link.state != "joining":  # dropped or forgotten meanwhile: already handled
                return
            self._fail(link, f"join failed: {e!r}")
            log.error("NCCL link epoch %d to %s failed: %r", epoch, producer_id, e)
            if permanent_link_error(e):
                self.link_failures[producer_id] = self.max_link_failures
                log.error("no more NCCL links to %s: that error will repeat; its weights come "
                          "by file", producer_id)

    def _connect(self, link: Link) -> Any:
        return nccl.connect(link.unique_id, 0, link.world_size, self.device)

    def _join_and_abort(self, link: Link) -> None:
        """Blocking: the rendezvous of an expired offer, only so the producer's engine returns."""
        try:
            nccl.abort(self._connect(link))
        except Exception as e:
            log.warning("NCCL link epoch %d to %s (expired): join failed: %r", link.epoch,
                        link.producer_id, e)

    def drop(self, producer_id: str, epoch: int) -> bool:
        """The producer gave link ``epoch`` up: drop our end too (counted as a failure) so that
        ``maintain`` offers a new one. Returns whether a live link was dropped."""
        link = self.links.get(producer_id)
        if not link_droppable(link, epoch):
            return False
        assert link is not None
        self._fail(link, "the producer dropped it")
        log.warning("NCCL link epoch %d: %s dropped it; a new one will be offered", epoch,
                    producer_id)
        return True

    # ------------------------------------------------------------------ ipc bucket slots
    def _slot_fields(self, producer_id: str, nbytes: int, ranges: list[tuple[int, int]]
                     ) -> dict[str, Any]:
        """The IPC fields of ``producer_id``'s two slots (made, or made larger, on demand; an
        old pair stays alive while its producer still maps it, as any IPC export does)."""
        slots = self._slots.get(producer_id)
        if slots is None or slots.nbytes < nbytes:
            if slots is not None:
                slots.control.close()
            tensors = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                       for _ in range(2)]
            path = control_path(self.shm_dir, os.getpid(), producer_id)
            slots = Slots(tensors, [ipc_export(t, self.gpu_uuid) for t in tensors],
                          ControlBlock(path, create=True), threading.Lock())
            self._slots[producer_id] = slots
        return {"slots": slots.handles, "control": slots.control.path,
                "buckets": [[s, e] for s, e in ranges], "gpu_uuid": self.gpu_uuid}

    async def _serve_slots(self, producer_id: str, version: int) -> str:
        """The IPC producer is paused for ``version``: hand it over bucket by bucket."""
        slots = self._slots[producer_id]
        with self._lock:
            entry = self._held.get(version)
        held = entry is not None and not entry[0].is_cuda
        try:
            await asyncio.to_thread(self._serve_slots_blocking, slots, version,
                                    entry if held else None)
        except Exception as e:
            self.send_failures += 1
            log.error("IPC hand-over of v%d to %s failed (%r); it loads the snapshot file",
                      version, producer_id, e)
            return "failed"
        self.sends += int(held)
        return "send" if held else "refuse"

    def _serve_slots_blocking(self, slots: Slots, version: int, entry: tuple | None) -> None:
        deadline = time.monotonic() + self.timeout_s
        with slots.lock, torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)  # never the training stream
            with torch.cuda.stream(stream):
                serve_buckets(slots.control, version, None if entry is None else entry[0],
                              [] if entry is None else entry[3], slots.tensors, deadline)

    async def send(self, producer_id: str, epoch: int, version: int) -> str:
        """Answer SyncReady("weights"): returns what was done (see ``ready_reply``). An IPC
        producer with bucket slots is served through them (``_serve_slots``)."""
        if producer_id in self._slots and producer_id not in self.links:
            return await self._serve_slots(producer_id, version)
        link = self.links.get(producer_id)
        deadline = time.monotonic() + self.timeout_s
        while link is not None and link.epoch == epoch and link.state == "joining" \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # its join finished first; ours is about to
        reply = ready_reply(link, epoch, version, self.held())
        if reply == "ignore" or link is None:
            log.warning("%s waits for v%d on NCCL link epoch %d, which is not up here; it will "
                        "time out and load the snapshot file", producer_id, version, epoch)
            return reply
        with self._lock:
            entry = self._held.get(version) if reply == "send" else None
        try:
            await asyncio.to_thread(self._send_blocking, link.comm, entry, version)
            self.sends += 1
        except Exception as e:
            self.send_failures += 1
            self._fail(link, f"send of v{version} failed: {e!r}")
            log.error("NCCL send of v%d to %s failed (%r); it loads the snapshot file",
                      version, producer_id, e)
            return "failed"
        return reply if entry is not None else "refuse"

    def _send_blocking(self, comm: Any, entry: tuple | None, version: int) -> None:
        """Header (version or -1, bytes, buckets), then per bucket a header (index, bytes,
        checksum) and the bucket: from the packed GPU buffer itself, or, for a version held in
        host memory, through one staging bucket on our GPU (on a side stream)."""
        deadline = time.monotonic() + self.timeout_s
        with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
            flat = entry[0] if entry is not None else None
            size = total_bytes(entry[1]) if entry is not None else 0
            ranges = entry[3] if entry is not None else []
            header = torch.tensor([version if flat is not None else -1, size, len(ranges)],
                                  dtype=torch.int64, device=self.device)
            nccl.timed_broadcast(comm, header, deadline=deadline, what=f"header of v{version}")
            if flat is None:
                return
            # One bucket per transfer (transfers to several producers may overlap); the
            # caching allocator hands the same memory back for the next one.
            staging = None if flat.is_cuda else torch.empty(
                max((e - s for s, e in ranges), default=0), dtype=torch.uint8,
                device=self.device)
            for i, (start, end) in enumerate(ranges):
                if staging is None:
                    buf = flat[start:end]
                else:
                    buf = staging[:end - start]
                    buf.copy_(flat[start:end], non_blocking=True)
                h = torch.tensor([i, end - start, word_sum(buf)], dtype=torch.int64,
                                 device=self.device)
                nccl.timed_broadcast(comm, h, deadline=deadline,
                                     what=f"header of v{version} bucket {i}")
                nccl.timed_broadcast(comm, buf, deadline=deadline,
                                     what=f"v{version} bucket {i} of {len(ranges)}")

    def close(self) -> None:
        for link in self.links.values():
            self._drop(link)
        self.links.clear()
        with self._lock:
            self._held.clear()
        for slots in self._slots.values():
            slots.control.close()
            with contextlib.suppress(OSError):
                os.unlink(slots.control.path)
        self._slots.clear()
