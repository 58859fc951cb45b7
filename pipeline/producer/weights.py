"""The weights one vLLM engine runs: every way a version gets into it, behind one ``load``.

Owns, for one engine: the request tracker (the version each token is tagged with, the admission
gate), the sync barrier around a load (``sync.barrier``), the engine's end of each weight route
(``sync.routes``: the file, or its stream for an engine on another node; ipc and nccl where the
learner may send GPU copies), how versions are served (the run's LoRA adapter plan: full weights,
adapters merged as they load, or LoRA adapters, ``pipeline.producer.adapters``), and the GPUs the
engine's workers run on, which the route planning reads. Three roles load versions through it;
what differs between them is constructor arguments, not code: the producer (every route, the
run's barrier), the dedicated evaluator (snapshot files only) and ``pipeline-train eval`` (a
checkpoint's full snapshot, barrier mode "keep").

``load`` never raises for a failed load: the report says so (``SwapReport.ok``) and the engine
runs the version it ran before, resumed (the barrier's ``finally``). A GPU route that fails is
followed at once by a file swap to the same version (``sync.routes.base.swap_with_fallback``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.keys import curve_keys
from pipeline.producer.adapters import AdapterSet
from sync.barrier import BarrierMode, RequestTracker, SwapBarrier, SwapReport
from sync.lora import adapter_config
from sync.routes import make_route, plan_route
from sync.routes.base import WeightRoute, swap_with_fallback
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)
SendReady = Callable[[str, int, int], Awaitable[None]]
"""(purpose, epoch, version): tells the learner this engine's end of a NCCL link is ready."""


def weight_routes(engine: Any, cfg: RunConfig, owner: str,
                  send_ready: SendReady | None = None) -> dict[str, WeightRoute]:
    """The engine's end of each route the learner may name, by that name. Its ``file`` reads
    snapshot files where the learner wrote them, or, with ``sync.stream_from`` set (an engine on
    another machine), is the stream route: each file streamed into a directory of this node
    first (``sync.routes.stream``). Without ``send_ready`` (an engine the learner sends no GPU
    copy), the file route only."""
    s = cfg.sync
    routes = {"file": make_route("file", engine)}
    if send_ready is not None:
        routes["ipc"] = make_route("ipc", engine, producer_id=owner, send_ready=send_ready,
                                   timeout_s=s.nccl_timeout_s)
        routes["nccl"] = make_route("nccl", engine, send_ready=send_ready,
                                    timeout_s=s.nccl_timeout_s)
    if not s.stream_from:
        return routes
    import tempfile

    from sync.stream import StreamKeys

    curve = curve_keys(cfg, "producer")
    keys = StreamKeys(curve.server_public, None, curve.client_public, curve.client_secret) \
        if curve is not None else None
    local = Path(tempfile.gettempdir()) / f"pipeline-grpo-stream-{owner}-{os.getpid()}"
    log.info("%s: weights streamed from %s into %s", owner, s.stream_from, local)
    routes["file"] = make_route("stream", engine, addr=s.stream_from, keys=keys,
                                local_dir=local, timeout_s=s.load_timeout_s)
    return routes


class EngineWeights:
    """The weights of one engine and the one way versions get in (the module docstring)."""

    def __init__(self, engine: Any, cfg: RunConfig, owner: str,
                 routes: dict[str, WeightRoute], *,
                 probe: Callable[[], dict[str, tuple[bool, int]]] | None = None,
                 barrier_mode: BarrierMode | None = None, serving: str | None = None):
        """``owner``: the producer's id, for logs and the adapters' directory. ``routes``: by
        the names the learner uses (``weight_routes``); with "file" only, every version comes
        from its file. ``probe``: the tracker's view of the engine's requests (FINAL_ONLY
        streaming, ``pipeline.producer.engine.engine_progress``). ``barrier_mode``: None for the
        run's ``sync.barrier``. ``serving``: None for the run's LoRA adapter plan
        (``RunConfig.adapter_plan``); "" for snapshots that hold every weight whatever the
        plan."""
        self.engine, self.owner, self.routes = engine, owner, routes
        self.tracker = RequestTracker(probe=probe)
        s, t = cfg.sync, cfg.train
        self.barrier = SwapBarrier(engine, self.tracker, mode=barrier_mode or s.barrier,
                                   drain_timeout_s=s.drain_timeout_s,
                                   pause_timeout_s=s.pause_timeout_s,
                                   load_timeout_s=s.load_timeout_s)
        targets = list(t.lora_target_modules)
        # "lora": versions are LoRARequests, not weight loads; "merge": adapter files merged
        # into the weights as they load; "": full weights.
        self.serving = cfg.adapter_plan.serving if serving is None else serving
        self.lora_rank, self.lora_alpha = t.lora_rank, t.lora_alpha
        self.adapters: AdapterSet | None = None
        if self.serving == "lora":
            self.adapters = AdapterSet(engine, f"lora-{owner}-{os.getpid()}",
                                       adapter_config(t.lora_rank, t.lora_alpha, targets))
            log.info("%s: serves each version as a LoRA adapter (rank %d, sync.lora_adapters)",
                     owner, t.lora_rank)
        self.devices: list[str] = []  # GPU UUID per worker (the producer reads them at start)

    @property
    def version(self) -> int:
        """The version the engine runs: new requests and new tokens are tagged with it."""
        return self.tracker.version

    async def start(self) -> None:
        """Before the first load: with adapters merged as they load, the workers are told."""
        if self.serving == "merge":
            await self.engine.collective_rpc("sync_lora_merge",
                                             args=(self.lora_alpha / self.lora_rank,))
            log.info("%s: merges each version's LoRA adapter (rank %d) into its weights as it "
                     "loads (sync.lora_adapters merge)", self.owner, self.lora_rank)

    async def connect(self, route: str, transfer: dict[str, Any]) -> None:
        """What ``route`` needs before a version can come by it (a NCCL link to join), on
        every announce."""
        if route in self.routes:
            await self.routes[route].connect(transfer, self.owner)

    def lora_request(self, version: int) -> Any:
        """``version``'s LoRA adapter under adapter-only sync (None otherwise, or for the base
        weights), for requests that do not go through the tracker (evaluation)."""
        return self.adapters.requests.get(version) if self.adapters is not None else None

    async def load(self, ref: SnapshotRef, route: str = "file",
                   transfer: dict[str, Any] | None = None) -> SwapReport | None:
        """Make the engine run ``ref.version``, by ``route`` (the one the learner names for us;
        ``transfer``: its Announce's) when its payload is usable here, else by the file. None
        when the version can only come from its file and that is not written yet (``ref.uri``
        ""): the next announce brings it."""
        transfer = transfer or {}
        if self.adapters is not None:
            # A new adapter for new requests, no pause (AdapterSet.swap says why that is safe).
            if not ref.uri:
                return None
            report = await self.adapters.swap(ref, self.tracker)
            if report.ok:
                self.barrier.swaps += 1
            else:
                self.barrier.failures += 1
            return report
        used, why = self._plan(ref, route, transfer)
        if used == "file" and not ref.uri:
            log.debug("%s: v%d waits for its file (%s)", self.owner, ref.version, why)
            return None
        if why:
            log.warning("%s: v%d by file instead of %s: %s", self.owner, ref.version, route,
                        why)
        load, prepare = self.routes[used].steps(ref, transfer)
        return await swap_with_fallback(self.barrier, used, ref, self.routes["file"], load=load,
                                        prepare=prepare)

    def _plan(self, ref: SnapshotRef, route: str, transfer: dict[str, Any]) -> tuple[str, str]:
        """The route ``ref`` takes here and, when the file stands in for ``route``, why."""
        if route == "file" or self.serving == "merge":  # an adapter's file: no GPU route
            return "file", ""
        nccl: Any = self.routes.get("nccl")
        used, why = plan_route(route, transfer, self.owner, self.devices,
                               nccl.joined if nccl is not None else None)
        if used != "file" and transfer.get("version") != ref.version:
            used, why = "file", f"the GPU copy on offer is v{transfer.get('version')}"
        if used not in self.routes:
            used, why = "file", f"this engine has no {used} route"
        return used, why

    def close(self) -> None:
        """Release what the routes and adapters hold on this machine."""
        for route in self.routes.values():
            route.close()
        if self.adapters is not None:
            self.adapters.close()
