"""The stream route: the file route for a producer that cannot read the learner's files (on
another machine, ``sync.stream_from``). Its stage streams the announced file from the learner's
``sync.stream.SnapshotServer`` into a directory of this node, checked against the announced
checksum, then stages that copy exactly as the file route does; its apply is the file route's.
So a torn or tampered stream never pauses the engine. Its learner end is that server, which the
learner starts with ``sync.serve_stream`` (``pipeline.learner.routes.serve_stream``)."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from sync.routes.file import FileRoute
from sync.snapshot import SnapshotError, SnapshotRef, prune_snapshots
from sync.stream import SNAPSHOT_FILE_NAME, StreamKeys, fetch_snapshot


class StreamRoute(FileRoute):
    """``stage`` first streams the version into ``local_dir`` (keeping the ``keep`` newest
    copies), then stages that copy like any snapshot file."""

    name = "stream"

    def __init__(
        self,
        engine: Any,
        addr: str,
        keys: StreamKeys | None,
        local_dir: str | Path,
        keep: int = 2,
        timeout_s: float = 30.0,
    ):
        super().__init__(engine)
        self.addr, self.keys, self.keep, self.timeout_s = addr, keys, keep, timeout_s
        self.local_dir = Path(local_dir)
        self.fetches = 0
        self.bytes = 0

    async def stage(self, ref: SnapshotRef) -> dict[str, float]:
        t0 = time.perf_counter()
        local = self.local_dir / Path(ref.uri).name
        if not SNAPSHOT_FILE_NAME.match(local.name):
            raise SnapshotError(f"snapshot v{ref.version}: unexpected file name {ref.uri!r}")
        got, n = await fetch_snapshot(self.addr, ref, local, self.keys, timeout_s=self.timeout_s)
        stream_s = time.perf_counter() - t0
        self.fetches += 1
        self.bytes += n
        await asyncio.to_thread(prune_snapshots, self.local_dir, self.keep)
        timings = await super().stage(got)
        return timings | {"stream_s": stream_s, "stream_bytes": float(n)}

    def close(self) -> None:
        shutil.rmtree(self.local_dir, ignore_errors=True)
