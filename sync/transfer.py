"""Weight transports: how a snapshot gets from the learner into every vLLM worker.

Transport ``file`` (the one implemented; any device, same host or a shared filesystem): the
learner writes a safetensors file (``sync.snapshot``); each worker stages it (read + verify,
engine still serving) and applies it inside the barrier's pause, through the worker extension
(``sync.worker_ext``) via ``AsyncLLM.collective_rpc``. Only a path and a checksum cross the
engine boundary.
"""

from __future__ import annotations

from typing import Any

from sync.snapshot import SnapshotRef


class FileTransport:
    def __init__(self, engine: Any):
        self.engine = engine

    async def _rpc(self, method: str, *args: Any) -> dict[str, float]:
        results = await self.engine.collective_rpc(method, args=args)
        first = results[0] if isinstance(results, list) and results else {}
        return first if isinstance(first, dict) else {}

    async def stage(self, ref: SnapshotRef) -> dict[str, float]:
        """Read and verify ``ref`` in every worker (no pause needed)."""
        return await self._rpc("sync_stage_snapshot", ref.version, ref.uri, ref.checksum)

    async def apply(self, version: int) -> dict[str, float]:
        """Load the staged snapshot (call inside the barrier's pause)."""
        return await self._rpc("sync_apply_staged", version)
