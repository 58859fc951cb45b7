"""The nccl route (learner and engine on different GPUs), producer end. A collective, so it runs
entirely inside the pause: the producer tells the learner it is paused (``SyncReady``), the
worker posts the receive, the learner broadcasts a small header (version, size, buckets) and then
each bucket (``sync.bucket_mb``) with its own header (index, size, checksum); the worker loads
each bucket as it arrives, so neither side holds a second whole model on a GPU. The learner's
end is ``sync.publish.WeightPublisher``; the communicator is ``sync.nccl``'s.

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
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from sync.routes.base import Step, WeightRoute
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)


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
    gpu_copy = True
    linked = True

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
