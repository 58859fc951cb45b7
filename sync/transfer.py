"""Weight transports, producer side: how a snapshot gets from the learner into every vLLM worker.

Three transports behind the same two calls the barrier makes (``stage`` while the engine serves,
``apply`` inside its pause), all reaching the workers through the worker extension
(``sync.worker_ext``) via ``AsyncLLM.collective_rpc``:

- ``file`` (any device; the default on CPU): the learner writes a safetensors snapshot
  (``sync.snapshot``); workers read + verify it (stage) and load it (apply). The learner writes
  this file for *every* version whatever the transport: it is the fallback when a GPU transport
  fails, and how a restarted producer or one without a working link catches up.
- ``ipc`` (learner and engine on the same GPU): the learner packs the version into one GPU buffer
  (``sync.packing``) and announces its CUDA IPC handle as plain msgpack fields; workers open it
  (stage: a mapping, no copy) and ``load_weights`` reads the learner's memory directly (apply).
  A sharded learner keeps the version in host memory instead (no room for a second model on
  its GPU): the worker opens two bucket slots at stage, and inside the pause tells the learner
  it waits (``SyncReady``) and loads each bucket as the learner fills a slot (``sync.slots``).
- ``nccl`` (learner and engine on different GPUs): a collective, so it runs entirely inside the
  pause: the producer tells the learner it is paused (``SyncReady``), the worker posts the
  receive, the learner broadcasts a small header (version, size, buckets) and then each bucket
  (``sync.bucket_mb``) with its own header (index, size, checksum); the worker loads each
  bucket as it arrives, so neither side holds a second whole model on a GPU.

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

Failure policy (``swap_with_fallback``): a GPU transport that fails or times out is a counted,
reported swap failure (engine resumed on v by the barrier), followed at once by a file swap to the
same version, so nothing is lost; the ack carries ``fallback = 1``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal

from sync.barrier import SwapBarrier, SwapReport
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)

Route = Literal["file", "ipc", "nccl"]
TRANSPORTS = ("auto", "file", "ipc", "nccl")


class TransportChoiceError(ValueError):
    """A transport that cannot work with this placement (the message says why and what to use)."""


def choose_transport(requested: str, learner_gpu: str | None, producer_gpus: list[str]) -> Route:
    """The transport for one producer, from GPU UUIDs (None / [] = CPU).

    ``auto``: ``file`` on CPU, ``ipc`` when every worker of the producer is on the learner's GPU,
    ``nccl`` when none is, ``file`` otherwise (tensor-parallel workers straddling the learner's
    GPU). An explicit choice that cannot work raises TransportChoiceError.
    """
    if requested not in TRANSPORTS:
        raise TransportChoiceError(f"unknown transport {requested!r} (choose from {TRANSPORTS})")
    if requested == "file":
        return "file"
    on_gpu = learner_gpu is not None and bool(producer_gpus) and all(producer_gpus)
    same = on_gpu and all(g == learner_gpu for g in producer_gpus)
    apart = on_gpu and learner_gpu not in producer_gpus
    if requested == "auto":
        return "ipc" if same else "nccl" if apart else "file"
    if not on_gpu:
        raise TransportChoiceError(f"transport {requested!r} needs the learner and the producer "
                                   f"on CUDA GPUs (learner: {learner_gpu or 'cpu'}, producer: "
                                   f"{producer_gpus or 'cpu'}); use 'file' or 'auto'")
    if requested == "ipc" and not same:
        raise TransportChoiceError(f"transport 'ipc' needs the producer on the learner's GPU "
                                   f"({learner_gpu}); it is on {producer_gpus}: use 'nccl'")
    if requested == "nccl" and not apart:
        raise TransportChoiceError(f"transport 'nccl' needs the producer on other GPUs than the "
                                   f"learner's ({learner_gpu}); it is on {producer_gpus}: NCCL "
                                   f"cannot put two ranks on one GPU, use 'ipc'")
    return requested  # type: ignore[return-value]


def plan_route(route: str, transfer: dict[str, Any], producer_id: str, my_gpus: list[str],
               joined: bytes | None) -> tuple[Route, str]:
    """What a producer actually uses for an announced version: the learner's route if its payload
    is there and usable here, else ``file``, with the reason (logged by the caller)."""
    if route == "ipc":
        handles = transfer.get("ipc")
        ipc = handles.get(producer_id) if isinstance(handles, dict) else None
        if not isinstance(ipc, dict) or "layout" not in transfer:
            return "file", "announce has no IPC handle for this producer"
        if not my_gpus or any(g != ipc.get("gpu_uuid") for g in my_gpus):
            return "file", (f"IPC handle is for GPU {ipc.get('gpu_uuid')}, this engine is on "
                            f"{my_gpus or 'cpu'}")
        return "ipc", ""
    if route == "nccl":
        link = nccl_offer(transfer, producer_id)
        if link is None or "layout" not in transfer:
            return "file", "no NCCL link offered to this producer yet"
        if joined != link["unique_id"]:  # epochs restart with a new learner; ids do not
            return "file", f"NCCL link epoch {link['epoch']} not joined"
        return "nccl", ""
    return "file", "" if route in ("", "file") else f"unknown route {route!r}"


def nccl_offer(transfer: dict[str, Any], producer_id: str) -> dict[str, Any] | None:
    """This producer's NCCL link offer in an Announce payload, type-checked, or None."""
    links = transfer.get("nccl")
    link = links.get(producer_id) if isinstance(links, dict) else None
    if not isinstance(link, dict):
        return None
    ok = (type(link.get("epoch")) is int and type(link.get("world_size")) is int
          and isinstance(link.get("unique_id"), bytes) and type(link.get("rank_offset")) is int)
    return link if ok else None


class _Rpc:
    def __init__(self, engine: Any):
        self.engine = engine

    async def _rpc(self, method: str, *args: Any) -> dict[str, float]:
        results = await self.engine.collective_rpc(method, args=args)
        first = results[0] if isinstance(results, list) and results else {}
        return first if isinstance(first, dict) else {}

    async def apply(self, version: int) -> dict[str, float]:
        """Load the staged version into the model (call inside the barrier's pause)."""
        return await self._rpc("sync_apply_staged", version)


class FileTransport(_Rpc):
    async def stage(self, ref: SnapshotRef) -> dict[str, float]:
        """Read and verify ``ref`` in every worker (no pause needed)."""
        return await self._rpc("sync_stage_snapshot", ref.version, ref.uri, ref.checksum)


class IpcTransport(_Rpc):
    """Producer end of CUDA IPC. Whole: the learner's packed buffer is opened at stage and read
    by the apply. Bucketed (a sharded learner, whose version waits in host memory): stage opens
    its two bucket slots; the apply tells the learner we are paused (``send_ready``, as for
    NCCL) and loads each bucket as the learner fills a slot (``sync.slots``)."""

    def __init__(self, engine: Any, producer_id: str,
                 send_ready: Callable[[str, int, int], Awaitable[None]] | None = None,
                 timeout_s: float = 30.0):
        super().__init__(engine)
        self.producer_id = producer_id  # whose handle in the payload's {producer id: handle}
        self.send_ready, self.timeout_s = send_ready, timeout_s
        self._bucketed: int | None = None  # the version staged bucketed

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


class NcclTransport(_Rpc):
    """Producer end of a NCCL link. ``send_ready(purpose, epoch, version)`` tells the learner
    (a SyncReady message; the producer owns the socket)."""

    def __init__(self, engine: Any, send_ready: Callable[[str, int, int], Awaitable[None]],
                 timeout_s: float):
        super().__init__(engine)
        self.send_ready, self.timeout_s = send_ready, timeout_s
        self.link: dict[str, Any] | None = None  # the offer this engine's workers joined
        self._dropping: asyncio.Future | None = None  # a "drop" sent while being cancelled

    @property
    def joined(self) -> bytes | None:
        return self.link["unique_id"] if self.link is not None else None

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


async def swap_with_fallback(barrier: SwapBarrier, route: Route, ref: SnapshotRef,
                             file: FileTransport,
                             load: Callable[[], Awaitable[Any]] | None = None,
                             prepare: Callable[[], Awaitable[Any]] | None = None) -> SwapReport:
    """Swap to ``ref.version`` through ``route`` (its ``load``/``prepare``); if that fails, swap
    again through the snapshot file, if it is written yet (``ref.uri``). The report is the last
    swap's; ``timings['fallback']`` is 1 and ``error`` names the GPU transport's failure when the
    file had to step in."""
    file_swap = (partial(file.apply, ref.version), partial(file.stage, ref))
    if route == "file" or load is None:
        return await barrier.swap(ref.version, file_swap[0], prepare=file_swap[1])
    first = await barrier.swap(ref.version, load, prepare=prepare)
    if first.ok:
        first.timings[f"{route}_s"] = first.timings.get("load_s", 0.0)
        return first
    if not ref.uri:  # announced before its file was written: the next announce brings the file
        return first
    log.warning("v%d over %s failed (%s); loading it from the snapshot file", ref.version,
                route, first.error)
    second = await barrier.swap(ref.version, file_swap[0], prepare=file_swap[1])
    second.timings["fallback"] = 1.0
    second.timings["failed_transport_total_s"] = first.timings.get("total_s", 0.0)
    second.error = (f"{route} failed ({first.error}); " + (second.error or "loaded from file")
                    if second.ok else f"{route} failed ({first.error}); file: {second.error}")
    return second
