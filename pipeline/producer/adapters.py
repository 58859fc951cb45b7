"""The producer's LoRA adapters under adapter-only sync: one ``LoRARequest`` per version.

Owns: the adapter directory of each version this producer serves, the engine's loaded
adapters, and which version new requests use. A swap is ``stage`` (verify the snapshot, write
the adapter directory, ``add_lora`` it, while the engine serves) then ``switch`` (new requests
get the new version's adapter); ``swap`` does both with no engine pause. Invariants:
- a request keeps the adapter of the version it was admitted under until it finishes, so all
  its tokens come from that version (per-token tags need no swap boundaries);
- an adapter is removed from the engine (``remove_lora``) and its directory deleted once it is
  neither the current version nor used by any request in flight;
- version 0 (the learner's base weights; peft initialises B to zero) runs without an adapter.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from sync.barrier import RequestTracker, SwapReport
from sync.lora import stage_adapter
from sync.snapshot import SnapshotRef

log = logging.getLogger(__name__)


class AdapterSet:
    def __init__(self, engine: Any, subdir: str, config: dict[str, Any]):
        self.engine = engine
        self.subdir = subdir  # our folder beside the snapshot files (one per producer process)
        self.directory: Path | None = None
        self.config = config  # peft adapter_config.json contents (sync.lora.adapter_config)
        self.current = 0
        self.requests: dict[int, Any] = {}  # version -> LoRARequest, staged or in use
        self.users: dict[int, int] = {}  # version -> requests in flight on it
        # vLLM knows an adapter by its id and refuses one it holds: a restarted learner's
        # version is another adapter under an old number, so ids are never reused.
        self._ids = itertools.count(1)

    def request_for(self, version: int) -> Any:
        """The LoRARequest of ``version`` (None for the base weights); count one user."""
        self.users[version] = self.users.get(version, 0) + 1
        return self.requests.get(version)

    async def release(self, version: int) -> None:
        """A request on ``version`` finished: drop adapters nobody uses any more."""
        self.users[version] = self.users.get(version, 1) - 1
        if self.users[version] <= 0:
            del self.users[version]
        await self._collect()

    async def stage(self, ref: SnapshotRef) -> dict[str, float]:
        """Verify ``ref``, write its adapter directory and load it into the engine (the engine
        keeps serving: nothing of the running requests changes)."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        self.directory = Path(ref.uri).parent / self.subdir
        path = stage_adapter(ref, self.config, self.directory / f"v{ref.version}")
        t1 = time.perf_counter()
        n = next(self._ids)
        name = f"v{ref.version}" if n == ref.version else f"v{ref.version}.{n}"
        req = LoRARequest(name, n, str(path))
        if not await self.engine.add_lora(req):
            raise RuntimeError(f"vLLM refused LoRA adapter v{ref.version} ({path})")
        # A version staged before (by a learner since restarted): its adapter leaves the
        # engine now, unless requests still run on it (then it stays until vLLM evicts it).
        old = self.requests.get(ref.version)
        self.requests[ref.version] = req
        if old is not None and not self.users.get(ref.version):
            with contextlib.suppress(Exception):
                await self.engine.remove_lora(old.lora_int_id)
        return {
            "write_s": t1 - t0,
            "add_lora_s": time.perf_counter() - t1,
            "bytes": float((path / "adapter_model.safetensors").stat().st_size),
        }

    async def switch(self, version: int) -> dict[str, float]:
        """New requests use ``version``'s adapter from now on."""
        if version not in self.requests:
            raise RuntimeError(f"LoRA adapter v{version} was not staged")
        self.current = version
        await self._collect()
        return {}

    async def swap(self, ref: SnapshotRef, tracker: RequestTracker) -> SwapReport:
        """Swap to ``ref.version`` with no pause: stage its adapter while the engine serves,
        then switch the adapter and the tracker's version in one step of the event loop.

        No barrier is needed: running requests keep their adapter, so nothing they compute
        changes (and vLLM keys prefix-cache blocks by adapter); a request admitted before the
        switch runs the old version and is tagged with it, one admitted after it the new one,
        as ``admit`` and ``request_for`` run with no await between them. Never raises: a
        failed stage leaves the current version in place (see ``report.ok``)."""
        t0 = time.perf_counter()
        try:
            staged = await self.stage(ref)
        except Exception as e:
            return SwapReport(
                version=tracker.version,
                ok=False,
                error=f"swap to v{ref.version} failed: LoRA adapter: {e}",
                timings={"total_s": time.perf_counter() - t0},
            )
        t1 = time.perf_counter()
        tracker.set_version(ref.version)
        await self.switch(ref.version)  # sets ``current`` before its first await
        timings = {f"prepare_{k}": v for k, v in staged.items()}
        timings |= {
            "prepare_s": t1 - t0,
            "idle_s": 0.0,
            "load_s": time.perf_counter() - t1,
            "total_s": time.perf_counter() - t0,
        }
        return SwapReport(version=tracker.version, ok=True, timings=timings)

    def unused(self) -> list[int]:
        """Staged versions that are not current and have no request in flight."""
        return [v for v in self.requests if v != self.current and not self.users.get(v)]

    async def _collect(self) -> None:
        for v in self.unused():
            if v > self.current:
                continue  # staged for a swap that has not switched yet
            req = self.requests.pop(v)
            try:
                await self.engine.remove_lora(req.lora_int_id)
            except Exception as e:  # a leftover adapter costs a slot, never the run
                log.warning("removing LoRA adapter v%d failed: %r", v, e)
            if self.directory is not None:
                shutil.rmtree(self.directory / f"v{v}", ignore_errors=True)

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
