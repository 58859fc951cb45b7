"""The nccl route (learner and engine on different GPUs), both ends. A collective, so a version
moves entirely inside the pause: the producer tells the learner it is paused (``SyncReady``), the
worker posts the receive, the learner broadcasts a small header (version, size, buckets) and then
each bucket (``sync.bucket_mb``) with its own header (index, size, checksum); the worker loads
each bucket as it arrives, so neither side holds a second whole model on a GPU.

Where each part is:
  - learner end, ``NcclLearnerEnd``: one link per producer (offer, join, send, drop), sending
    from the packed copy the GPU routes share (``sync.routes.gpu_copy``);
  - producer end, ``NcclRoute``: joins the offered link and receives inside the barrier's pause;
  - the workers' side of both, ``sync_nccl_join`` and ``sync_nccl_receive`` of
    ``sync.worker_ext.WeightSyncExtension`` (the extension vLLM loads by name);
  - the communicator both sides build on, with its bounded waits: ``sync.nccl``.

Link life cycle, per producer (the learner is rank 0, the producer's workers 1..TP):
  offered  -- a new epoch and unique id, put in the Announce for that producer;
  joining  -- the producer sent SyncReady("link"): the learner joins in a thread
              (``ncclCommInitRank`` blocks until every rank has joined, so it is only called once
              the producer has said it is joining);
  ready    -- weights can flow: each SyncReady("weights", v) is answered with a header broadcast
              (v, bytes), or (-1, 0) if v is no longer held, then the packed buffer;
  dead     -- join or transfer failed or timed out (communicator aborted), or the producer sent
              SyncReady("drop"); the producer falls back to the snapshot file, and ``maintain``
              offers a new link (new epoch) while the producer is alive, up to
              ``max_link_failures`` in a row.
Every learner transfer runs in a worker thread on its own CUDA stream with a deadline; nothing
here can block the learner's event loop or its training stream.

Why our own NCCL link instead of vLLM's weight-transfer engine (``init_weight_transfer_engine``
/ ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``), which exists in both
vLLM 0.25.1 and 0.32.0:
  1. Atomicity. vLLM's engine streams into layerwise reload (``start_weight_update`` takes the
     model apart, ``update_weights`` loads as it receives); a broadcast that times out half-way
     leaves a half-loaded model with no rollback. The barrier's contract is "a failed load leaves
     the engine serving v": every bucket is checked (index, size, checksum) before it is
     loaded, and a bucket refused, missing or timed out after others were loaded makes the
     worker re-apply the previous snapshot before the error returns (the extension's rollback),
     so a torn set never serves a request. A model within one bucket is received whole first.
  2. Bounded waits. vLLM's worker blocks in ``torch.accelerator.synchronize()`` until the trainer
     sends; a dead learner hangs the engine core for ever. Our receive polls a CUDA event until a
     deadline and aborts the communicator (``ncclCommAbort``) on timeout.
  3. One link per producer, rebuilt at will. vLLM's rendezvous is one group per engine with a
     fixed world size, set up once; we need a link per producer (a dead one must not block the
     others), and a new link (new epoch) after an abort or a producer restart.
  4. No pickle, no engine arguments. vLLM's rendezvous pickles the NCCL unique id through a
     TCPStore, and its IPC engine imports ray and pickles handles over HTTP; the engine would also
     need ``weight_transfer_config``. Our unique id and IPC handles are bytes in the msgpack
     Announce, and the worker extension needs nothing new from the engine's configuration.
The pieces are still vLLM's: ``PyNcclCommunicator`` and ``StatelessProcessGroup``
(``sync.nccl``), and torch's own CUDA IPC rebuild (``sync.packing``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from sync import nccl
from sync.packing import total_bytes
from sync.routes.base import LearnerEnd, Step, WeightRoute
from sync.routes.gpu_copy import GpuCopies, PackedVersion
from sync.slots import word_sum
from sync.snapshot import SnapshotRef
from sync.threads import in_daemon_thread

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- producer end


def nccl_offer(transfer: dict[str, Any], producer_id: str) -> dict[str, Any] | None:
    """This producer's NCCL link offer in an Announce payload, type-checked, or None."""
    links = transfer.get("nccl")
    link = links.get(producer_id) if isinstance(links, dict) else None
    if not isinstance(link, dict):
        return None
    ok = (type(link.get("epoch")) is int and type(link.get("world_size")) is int
          and isinstance(link.get("unique_id"), bytes) and type(link.get("rank_offset")) is int)
    return link if ok else None


def nccl_unusable(transfer: dict[str, Any], producer_id: str, joined: bytes | None) -> str:
    """Why an announced version cannot come over NCCL to this producer ("" when it can): the
    announce must offer us a link, and the one we joined (``joined``: its unique id)."""
    link = nccl_offer(transfer, producer_id)
    if link is None or "layout" not in transfer:
        return "no NCCL link offered to this producer yet"
    if joined != link["unique_id"]:  # epochs restart with a new learner; ids do not
        return f"NCCL link epoch {link['epoch']} not joined"
    return ""


class NcclRoute(WeightRoute):
    """Producer end of a NCCL link. ``send_ready(purpose, epoch, version)`` tells the learner
    (a SyncReady message; the producer owns the socket)."""

    name = "nccl"

    def __init__(self, engine: Any, send_ready: Callable[[str, int, int], Awaitable[None]],
                 timeout_s: float):
        super().__init__(engine)
        self.send_ready, self.timeout_s = send_ready, timeout_s
        self.link: dict[str, Any] | None = None  # the offer this engine's workers joined
        self._dropping: asyncio.Future | None = None  # a "drop" sent while being cancelled
        self.failed_links: set[bytes] = set()  # offers we could not join (not retried)

    @property
    def joined(self) -> bytes | None:
        return self.link["unique_id"] if self.link is not None else None

    @staticmethod
    def unusable(transfer: dict[str, Any], producer_id: str, my_gpus: list[str],
                 joined: bytes | None) -> str:
        return nccl_unusable(transfer, producer_id, joined)

    def steps(self, ref: SnapshotRef, transfer: dict[str, Any]) -> tuple[Step, Step | None]:
        return partial(self.receive_and_apply, ref, transfer), None

    async def connect(self, transfer: dict[str, Any], producer_id: str) -> None:
        """Join the link the learner offers us, unless we hold it already. A join that fails
        is logged and not retried: the learner offers a new epoch, and meanwhile weights come
        by file."""
        link = nccl_offer(transfer, producer_id)
        if link is None or link["unique_id"] == self.joined or \
                link["unique_id"] in self.failed_links:
            return
        try:
            await asyncio.wait_for(self.join(link), self.timeout_s)
            log.info("%s: NCCL link epoch %d joined", producer_id, link["epoch"])
        except Exception as e:
            self.failed_links.add(link["unique_id"])
            log.error("%s: joining NCCL link epoch %d failed: %r", producer_id,
                      link["epoch"], e)

    async def join(self, link: dict[str, Any]) -> None:
        """Join link ``link['epoch']`` (the learner joins when it gets our SyncReady)."""
        self.link = None
        await self.send_ready("link", link["epoch"], 0)
        try:
            await self._rpc("sync_nccl_join", link["epoch"], link["unique_id"],
                            link["rank_offset"], link["world_size"], self.timeout_s)
        except (Exception, asyncio.CancelledError) as e:
            await self._give_up(link["epoch"], 0, e)  # the learner may have joined its end
            raise
        self.link = link

    async def _give_up(self, epoch: int, version: int, e: BaseException) -> None:
        """Forget link ``epoch`` and tell the learner ("drop"), so it drops its end and offers
        a new one instead of keeping a link we no longer hold."""
        self.link = None
        if isinstance(e, asyncio.CancelledError):  # being cancelled (a timeout): no awaiting
            self._dropping = asyncio.ensure_future(self.send_ready("drop", epoch, version))
        else:
            await self.send_ready("drop", epoch, version)

    async def receive_and_apply(self, ref: SnapshotRef, transfer: dict[str, Any]
                                ) -> dict[str, float]:
        """Inside the pause: announce we wait, receive the whole version, then apply it."""
        if self.link is None:
            raise RuntimeError("no NCCL link")
        epoch = self.link["epoch"]
        await self.send_ready("weights", epoch, ref.version)
        try:
            got = await self._rpc("sync_nccl_receive", ref.version, epoch, transfer["layout"],
                                  self.timeout_s, ref.uri, ref.checksum, transfer.get("buckets"))
        except (Exception, asyncio.CancelledError) as e:
            # The worker aborted its communicator (or will, at its own timeout): link gone.
            await self._give_up(epoch, ref.version, e)
            raise
        if got.get("refused"):
            raise RuntimeError(f"the learner no longer holds v{ref.version} (link kept)")
        return got | await self.apply(ref.version)


# ---------------------------------------------------------------------- learner end
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


def _abort_in_thread(comm: Any) -> None:
    """Abort a communicator without blocking the caller (an abort can wait on the peer)."""
    if comm is not None:
        threading.Thread(target=nccl.abort, args=(comm,), daemon=True).start()


class NcclLearnerEnd(LearnerEnd):
    """One link per nccl producer (``links``), and the sends over it. A version packed on our
    GPU is broadcast bucket by bucket straight from that buffer; a version in host memory (a
    sharded learner) through one staging bucket on our GPU per transfer."""

    name = "nccl"

    def __init__(self, copies: GpuCopies, timeout_s: float = 30.0, max_link_failures: int = 3):
        super().__init__(copies, timeout_s)
        self.max_link_failures = max_link_failures
        self._stream: torch.cuda.Stream | None = None  # made at the first send
        self.links: dict[str, Link] = {}
        self.link_failures: dict[str, int] = {}
        self._epoch = 0
        # Offers that expired before the producer took them up, by (producer, epoch): a late
        # join of one is completed and aborted at once (see ``join``). Only the newest few.
        self._expired: OrderedDict[tuple[str, int], Link] = OrderedDict()
        self.sends = 0
        self.send_failures = 0

    def offer(self, version: int, producers: list[str]) -> dict[str, Any]:
        offers = {}
        for pid in producers:
            link = self.links.get(pid)
            if link is not None and link.state in ("offered", "joining", "ready"):
                offers[pid] = link.offer()
                if link.since is None:
                    link.since = time.monotonic()  # the offer's clock starts now
        return {"nccl": offers} if offers else {}

    def maintain(self, producers: dict[str, tuple[bool, int]]) -> None:
        """Offer a link to each alive producer that has none that works."""
        now = time.monotonic()
        for pid, (alive, world) in producers.items():
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

    def on_sync_ready(self, producer_id: str, purpose: str, epoch: int, version: int
                      ) -> Coroutine[Any, Any, Any] | None:
        """SyncReady "link": join (a task); "weights": send (a task); "drop": drop our end at
        once."""
        if purpose == "drop":
            self.drop(producer_id, epoch)
            return None
        if purpose == "link":
            return self.join(producer_id, epoch)
        return self.send(producer_id, epoch, version)

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
        return nccl.connect(link.unique_id, 0, link.world_size, self.copies.device)

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

    async def send(self, producer_id: str, epoch: int, version: int) -> str:
        """Answer SyncReady("weights"): returns what was done (see ``ready_reply``), or
        ``failed``."""
        link = self.links.get(producer_id)
        deadline = time.monotonic() + self.timeout_s
        while link is not None and link.epoch == epoch and link.state == "joining" \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # its join finished first; ours is about to
        reply = ready_reply(link, epoch, version, self.copies.held())
        if reply == "ignore" or link is None:
            log.warning("%s waits for v%d on NCCL link epoch %d, which is not up here; it will "
                        "time out and load the snapshot file", producer_id, version, epoch)
            return reply
        packed = self.copies.get(version) if reply == "send" else None
        try:
            await asyncio.to_thread(self._send_blocking, link.comm, packed, version)
            self.sends += 1
        except Exception as e:
            self.send_failures += 1
            self._fail(link, f"send of v{version} failed: {e!r}")
            log.error("NCCL send of v%d to %s failed (%r); it loads the snapshot file",
                      version, producer_id, e)
            return "failed"
        return reply if packed is not None else "refuse"

    def _send_blocking(self, comm: Any, packed: PackedVersion | None, version: int) -> None:
        """Header (version or -1, bytes, buckets), then per bucket a header (index, bytes,
        checksum) and the bucket: from the packed GPU buffer itself, or, for a version held in
        host memory, through one staging bucket on our GPU (on a side stream)."""
        device = self.copies.device
        deadline = time.monotonic() + self.timeout_s
        # One side stream for every send: the caching allocator reuses a freed block (the
        # staging bucket) only on the stream it was made on, and a new stream a version (torch
        # hands out up to 32 from its pool) kept each version's staging bucket cached.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            flat = packed.flat if packed is not None else None
            size = total_bytes(packed.layout) if packed is not None else 0
            ranges = packed.ranges if packed is not None else []
            header = torch.tensor([version if flat is not None else -1, size, len(ranges)],
                                  dtype=torch.int64, device=device)
            nccl.timed_broadcast(comm, header, deadline=deadline, what=f"header of v{version}")
            if flat is None:
                return
            # One bucket per transfer (transfers to several producers may overlap); the
            # caching allocator hands the same memory back for the next one.
            staging = None if flat.is_cuda else torch.empty(
                max((e - s for s, e in ranges), default=0), dtype=torch.uint8, device=device)
            for i, (start, end) in enumerate(ranges):
                if staging is None:
                    buf = flat[start:end]
                else:
                    buf = staging[:end - start]
                    buf.copy_(flat[start:end], non_blocking=True)
                h = torch.tensor([i, end - start, word_sum(buf)], dtype=torch.int64,
                                 device=device)
                nccl.timed_broadcast(comm, h, deadline=deadline,
                                     what=f"header of v{version} bucket {i}")
                nccl.timed_broadcast(comm, buf, deadline=deadline,
                                     what=f"v{version} bucket {i} of {len(ranges)}")

    def close(self) -> None:
        for link in self.links.values():
            self._drop(link)
        self.links.clear()
