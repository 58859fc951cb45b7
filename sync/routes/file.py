"""The file route (any device; the default on CPU): the learner writes a safetensors snapshot
(``sync.snapshot``); workers read and verify it while the engine serves (stage) and load it
inside the pause (apply). The learner writes this file for *every* version whatever the route:
it is the fallback when a GPU route fails, and how a restarted producer or one without a working
link catches up. So its learner end needs no ``LearnerEnd``: it is ``sync.writer.SnapshotWriter``,
which the learner loop runs for every version."""

from __future__ import annotations

from functools import partial
from typing import Any

from sync.routes.base import Step, WeightRoute
from sync.snapshot import SnapshotRef


class FileRoute(WeightRoute):
    name = "file"

    async def stage(self, ref: SnapshotRef) -> dict[str, float]:
        """Read and verify ``ref`` in every worker (no pause needed)."""
        return await self._rpc("sync_stage_snapshot", ref.version, ref.uri, ref.checksum)

    def steps(self, ref: SnapshotRef, transfer: dict[str, Any]) -> tuple[Step, Step | None]:
        return partial(self.apply, ref.version), partial(self.stage, ref)
