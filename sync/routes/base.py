"""The weight route interface (both ends), the learner's choice of a route per producer, and
the fallback.

A weight route is how a version announced by the learner gets into every vLLM worker of one
engine. Producer end, a ``WeightRoute`` gives the barrier (``sync.barrier.SwapBarrier``) its two
calls for a version: ``prepare`` (run while the engine serves; may be None) and ``load`` (run
inside the pause), both reaching the workers through the worker extension (``sync.worker_ext``)
via ``AsyncLLM.collective_rpc``. Learner end, a ``LearnerEnd`` is what the learner holds and does
for the producers on a GPU route beside the packed copy those routes share
(``sync.routes.gpu_copy``): ipc's exported handles, nccl's links. The snapshot file, which the
learner writes for every version whatever the route, is the file route's learner end and needs
no object; a route without a ``LearnerEnd`` takes no GPU copy.

Failure policy (``swap_with_fallback``): a GPU route that fails or times out is a counted,
reported swap failure (engine resumed on v by the barrier), followed at once by a file swap to
the same version, so nothing is lost; the ack carries ``fallback = 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, ClassVar, Literal

from sync.barrier import SwapBarrier, SwapReport
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)

RouteName = Literal["file", "ipc", "nccl"]  # the routes the learner names in its Announce
ROUTE_OPTIONS = ("auto", "file", "ipc", "nccl")  # the values of the option sync.route
Step = Callable[[], Awaitable[Any]]


class RouteChoiceError(ValueError):
    """A route that cannot work with this placement (the message says why and what to use)."""


def choose_route(requested: str, learner_gpu: str | None, producer_gpus: list[str]) -> RouteName:
    """The route for one producer (``requested`` is the option ``sync.route``), from GPU
    UUIDs (None / [] = CPU).

    ``auto``: ``file`` on CPU, ``ipc`` when every worker of the producer is on the learner's GPU,
    ``nccl`` when none is, ``file`` otherwise (tensor-parallel workers straddling the learner's
    GPU). An explicit choice that cannot work raises RouteChoiceError.
    """
    if requested not in ROUTE_OPTIONS:
        raise RouteChoiceError(f"unknown route {requested!r} (choose from {ROUTE_OPTIONS})")
    if requested == "file":
        return "file"
    on_gpu = learner_gpu is not None and bool(producer_gpus) and all(producer_gpus)
    same = on_gpu and all(g == learner_gpu for g in producer_gpus)
    apart = on_gpu and learner_gpu not in producer_gpus
    if requested == "auto":
        return "ipc" if same else "nccl" if apart else "file"
    if not on_gpu:
        raise RouteChoiceError(f"route {requested!r} needs the learner and the producer "
                               f"on CUDA GPUs (learner: {learner_gpu or 'cpu'}, producer: "
                               f"{producer_gpus or 'cpu'}); use 'file' or 'auto'")
    if requested == "ipc" and not same:
        raise RouteChoiceError(f"route 'ipc' needs the producer on the learner's GPU "
                               f"({learner_gpu}); it is on {producer_gpus}: use 'nccl'")
    if requested == "nccl" and not apart:
        raise RouteChoiceError(f"route 'nccl' needs the producer on other GPUs than the "
                               f"learner's ({learner_gpu}); it is on {producer_gpus}: NCCL "
                               f"cannot put two ranks on one GPU, use 'ipc'")
    return requested  # type: ignore[return-value]


class WeightRoute:
    """One route's producer end (see the module docstring); the file route's is this base's
    ``apply`` with a staged snapshot file."""

    name: ClassVar[str]

    def __init__(self, engine: Any):
        self.engine = engine

    async def _rpc(self, method: str, *args: Any) -> dict[str, float]:
        results = await self.engine.collective_rpc(method, args=args)
        first = results[0] if isinstance(results, list) and results else {}
        return first if isinstance(first, dict) else {}

    async def apply(self, version: int) -> dict[str, float]:
        """Load the staged version into the model (call inside the barrier's pause)."""
        return await self._rpc("sync_apply_staged", version)

    @staticmethod
    def unusable(transfer: dict[str, Any], producer_id: str, my_gpus: list[str],
                 joined: bytes | None) -> str:
        """Why an announced version cannot come by this route here ("" when it can)."""
        return ""

    async def connect(self, transfer: dict[str, Any], producer_id: str) -> None:
        """Set up what the route needs before a version can come by it (on every announce)."""

    def steps(self, ref: SnapshotRef, transfer: dict[str, Any]) -> tuple[Step, Step | None]:
        """The barrier's ``load`` and ``prepare`` for ``ref`` (``transfer``: the Announce's)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the route holds on this machine."""


class LearnerEnd:
    """One GPU route's learner end (see the module docstring), over the packed copies it shares
    with the other GPU routes (``copies``, a ``sync.routes.gpu_copy.GpuCopies``). The learner
    (``pipeline.learner.routes``) calls each method with the producers it routes here; these
    defaults do nothing."""

    name: ClassVar[str]

    def __init__(self, copies: Any, timeout_s: float = 30.0):
        self.copies, self.timeout_s = copies, timeout_s

    def export(self, packed: Any, producers: list[str]) -> None:
        """Before ``packed`` (a ``PackedVersion``) goes on offer: what ``producers`` will need
        to take it (blocking; may raise, then that version goes by file)."""

    def offer(self, version: int, producers: list[str]) -> dict[str, Any]:
        """This route's fields in the Announce ``transfer`` for held ``version`` (plain msgpack
        data; {} when it offers nothing to ``producers``, the live ones on this route)."""
        return {}

    def maintain(self, producers: dict[str, tuple[bool, int]]) -> None:
        """Every announce: keep what ``producers`` need ({id: (alive, world size = 1 + its
        workers)}) set up."""

    def forget(self, producer_id: str) -> None:
        """A new process of ``producer_id``: what we held for the old one is useless."""

    def on_sync_ready(self, producer_id: str, purpose: str, epoch: int, version: int
                      ) -> Coroutine[Any, Any, Any] | None:
        """A SyncReady from a producer on this route: the work to run as a task (the learner
        runs it), or None when answered already."""
        log.warning("SyncReady(%s) from %s: the %s route does not take it; ignored", purpose,
                    producer_id, self.name)
        return None

    def close(self) -> None:
        """Release what this end holds."""


async def swap_with_fallback(barrier: SwapBarrier, route: RouteName, ref: SnapshotRef,
                             file: Any, load: Step | None = None,
                             prepare: Step | None = None) -> SwapReport:
    """Swap to ``ref.version`` through ``route`` (its ``load``/``prepare``); if that fails, swap
    again through the snapshot file (``file``: the file route), if it is written yet
    (``ref.uri``). The report is the last swap's; ``timings['fallback']`` is 1 and ``error``
    names the GPU route's failure when the file had to step in."""
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
